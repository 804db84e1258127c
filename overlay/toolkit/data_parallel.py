"""Data-parallel LoRA training over the ranks `torchrun` starts (`launcher run --gpus N`).

The trainer already holds an accelerate `Accelerator`, which joins the process group torchrun
describes (RANK, WORLD_SIZE, MASTER_ADDR...; NCCL on NVIDIA, RCCL on ROCm, gloo on the CPU).
What accelerate's `prepare` does with it does not fit this trainer: it wraps every module with a
trainable parameter in DistributedDataParallel, whose gradient hooks only fire through the
wrapper's forward, and the LoRA network's forward is never called (its layers patch the
transformer's Linears), while the frozen VAE makes DDP refuse to start. So the ranks place their
modules themselves and average the LoRA's gradients once per optimizer step, before clipping:
the step then sees the gradient of the global batch, as one process with N times the batch would.

Every rank reads its own share of the same data order (every N-th batch, from its own offset),
the main rank builds the caches while the others wait, reads the flag files and broadcasts them,
and writes what a single process would write. Nothing here does anything in a single process.
"""

import contextlib
import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from flux2_contract.files import rank_file
from flux2_contract.settings import read

LOADED_KEY = "flux2-24gb/main-rank-loaded"
LOAD_WAIT = datetime.timedelta(hours=12)
"""How long the other ranks wait for the main rank's caches: a first 4-bit quantization of
FLUX.2 [dev] takes minutes, far past NCCL's collective timeout, so the wait is on the store."""


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def active() -> bool:
    return world_size() > 1


def _store() -> dist.Store:
    """A client of the store torchrun's agent serves (MASTER_ADDR:MASTER_PORT), keys of this launch."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=LOAD_WAIT)
    return dist.PrefixStore(f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
                            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def die_with_agent() -> None:
    """Linux: this rank gets SIGKILL when torchrun's agent dies, as the agent does when the launcher
    dies (PR_SET_PDEATHSIG): no rank trains on without the run lock. Windows: the launcher's job
    object holds the whole tree already."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def before_loading() -> None:
    """Ranks other than the main one wait here until it has loaded the model, building the
    quantized cache and the text phase's embeddings, then read them: nothing is quantized or
    encoded twice. The latent and caption caches of the dataset come later, under the trainer's
    own `main_process_first`."""
    if not active():
        return
    die_with_agent()
    _write_state()
    threading.Thread(target=_beat, name="rank-heartbeat", daemon=True).start()
    if rank() != 0:
        print(f"rank {rank()}: waiting for rank 0 to load the model (the quantized cache, the text phase)", flush=True)
        _store().wait([LOADED_KEY], LOAD_WAIT)


def after_loading() -> None:
    """The main rank, once the model is loaded and its caches written: the others load theirs."""
    if active() and rank() == 0:
        _store().set(LOADED_KEY, "1")


def prepare_model(accelerator, model, device_placement: bool = True):
    """accelerate's `prepare` in a single process; with ranks the module is only placed (see the
    module docstring for why not DDP)."""
    if not active():
        return accelerator.prepare(model, device_placement=[device_placement])
    return model.to(accelerator.device) if device_placement else model


def _tensors(params) -> list[torch.Tensor]:
    """The parameters of the trainer's `params`: tensors, or param groups (dicts with 'params')."""
    found = []
    for item in params:
        found.extend(item["params"] if isinstance(item, dict) else [item])
    return found


def broadcast_parameters(params) -> None:
    """Every rank starts from the main rank's LoRA (the same seed gives the same one; a resumed
    checkpoint is read by all: this makes it so whatever the initialiser does)."""
    if active():
        for tensor in _tensors(params):
            dist.broadcast(tensor.data, 0)


_entered = 0  # collectives of the train loop this rank has entered
_waiting_since = None  # since when this rank waits in the last collective; None while it computes
_state_file = None
"""model_kwargs rank_state_file: `run` names a file (`<run>/rank-state.json`); rank R keeps
`rank-state.rank<R>.json` beside it: its pid, how many collectives of the train loop it has entered,
since when it waits in the last (null while it computes), and its heartbeat. The launcher's rank
watch (launcher/watchdog/rank_watch.py) reads them: a rank that keeps the others waiting past the
limit is the stalled one, whatever it is doing (sleeping, stopped, looping), and a rank whose
heartbeat is that old is frozen, even inside the collective the others wait in."""
_state_lock = threading.Lock()
BEAT_S = 2.0
"""Seconds between heartbeats: a thread of its own renews them while the rank computes or waits (a
collective releases the interpreter), so only a process that does not run lets them age."""


def configure(model_kwargs: dict) -> None:
    """The rank's state file as the run's config says (the train process, once its model config is read)."""
    global _state_file
    _state_file = read(model_kwargs, "rank_state_file")


def _write_state() -> None:
    """This rank's state file for the launcher's rank watch, replaced whole (a reader never sees half)."""
    path = _state_file
    if not path:
        return
    target = rank_file(path, rank())
    with _state_lock:  # the heartbeat thread writes it too
        state = {"rank": rank(), "pid": os.getpid(), "entered": _entered, "waiting_since": _waiting_since,
                 "beat": time.time()}
        try:
            with open(f"{target}.tmp", "w", encoding="utf-8") as handle:
                json.dump(state, handle)
            os.replace(f"{target}.tmp", target)
        except OSError as error:  # the watch goes blind on this rank; the training goes on
            print(f"rank {rank()}: writing {target} failed ({error}); the rank watch cannot see this rank", flush=True)


def _beat() -> None:
    while True:
        time.sleep(BEAT_S)
        _write_state()


@contextlib.contextmanager
def _waiting(tensor: torch.Tensor):
    """Marks a collective of the train loop: a rank inside it is waiting for the others. On a GPU
    the collective is queued, not done, when the call returns: the rank waits for its stream here,
    so that a wait is seen where it happens."""
    global _entered, _waiting_since
    _entered += 1
    _waiting_since = time.time()
    _write_state()
    try:
        yield
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
    finally:
        _waiting_since = None
        _write_state()


def average_gradients(params) -> None:
    """The mean of every rank's gradient, in one all-reduce per dtype: the global batch's gradient."""
    if not active():
        return
    grads = [tensor.grad for tensor in _tensors(params) if tensor.grad is not None]
    for dtype in {grad.dtype for grad in grads}:
        same = [grad for grad in grads if grad.dtype == dtype]
        flat = torch.cat([grad.reshape(-1) for grad in same])
        with _waiting(flat):
            dist.all_reduce(flat)
        flat /= world_size()
        offset = 0
        for grad in same:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def rank_share(iterator):
    """This rank's batches of `iterator`: every N-th from offset rank, the rest released. All ranks
    draw the same order (same seed), so together they train on what one process would; a last
    group shorter than N ends the epoch (as drop_last does)."""
    if not active():
        yield from iterator
        return
    while True:
        group = []
        for _ in range(world_size()):
            try:
                group.append(next(iterator))
            except StopIteration:
                return
        for index, batch in enumerate(group):
            if index != rank() and hasattr(batch, "cleanup"):
                batch.cleanup()
        yield group[rank()]


def flags_present(folder: str, names: tuple[str, ...], device) -> list[str]:
    """The flag files in `folder` as the main rank sees them, the same list on every rank: all
    ranks then save or stop at the same step (a rank that read the folder itself could see a
    flag one step before another)."""
    present = [name for name in names if rank() == 0 and os.path.exists(os.path.join(folder, name))]
    if not active():
        return present
    mask = torch.tensor([name in present for name in names], dtype=torch.int32, device=device)
    with _waiting(mask):
        dist.broadcast(mask, 0)
    return [name for name, seen in zip(names, mask.tolist()) if seen]
