"""Run the trainer with the training device set to cpu:0 and record what moves the model where.

Used by test_resident_training.py and test_no_round_trips.py as
`<venv python> record_model_moves.py CONFIG EVENTS_JSON`, from the trainer checkout. cpu:0 is
a device distinct from cpu for torch's bookkeeping, so a
move of the transformer "to the GPU" is visible on a CPU-only machine while the run still
trains on the CPU. EVENTS_JSON gets, in order:
  {"event": "model_to_device", "caller": <function that called Flux2.to(cpu:0)>}
  {"event": "placed", "transformer": <device>, "vae": <device>}   load_model has returned
  {"event": "move", "part": "transformer" | "vae", "from": <device>, "to": <device>, "caller": ...}
      after placement, a `.to()` / `.cpu()` on the transformer or the VAE, or on any module
      of theirs, that asks for another device than the part is on (what placement, or the
      last move, put it on: cpu and cpu:0 count as two devices here)
  {"event": "dataloader", "num_workers": N}   a torch DataLoader is built
  {"event": "te_unloaded"}     the text encoder is cached and unloaded
  {"event": "heap_trim", "caller": <function that called release_freed_memory>}   the heap's free
      pages are handed back to the OS (toolkit/host_memory.py; the real trim still runs)
  {"event": "train_step"}      a training step starts
"""

import json
import runpy
import sys

sys.path.insert(0, ".")

import accelerate
import torch

DEVICE = torch.device("cpu", 0)
CONFIG, EVENTS = sys.argv[1], sys.argv[2]
events = []
watched = {}  # id(module) -> "transformer" | "vae", filled once load_model has returned
where = {}  # part -> the device placement or the last move put it on
loading = {"transformer": torch.device("cpu")}  # the last device load_model asked of Flux2


def record(event, **fields):
    events.append({"event": event, **fields})
    with open(EVENTS, "w", encoding="utf-8") as f:
        json.dump(events, f)


accelerate.Accelerator.device = property(lambda self: DEVICE)
real_to = torch.nn.Module.to
real_cpu = torch.nn.Module.cpu


def record_move(module, device, caller):
    part = watched.get(id(module))
    if part is not None and where[part] != device:
        record("move", part=part, caller=caller, **{"from": str(where[part]), "to": str(device)})
        where[part] = device


def recording_to(self, *args, **kwargs):
    targets = [torch.device(a) for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))]
    caller = sys._getframe(1).f_code.co_name
    if type(self).__name__ == "Flux2" and DEVICE in targets:
        record("model_to_device", caller=caller)
    if type(self).__name__ == "Flux2" and targets and not watched:
        loading["transformer"] = targets[0]
    if targets:
        record_move(self, targets[0], caller)
    return real_to(self, *args, **kwargs)


def recording_cpu(self):
    record_move(self, torch.device("cpu"), sys._getframe(1).f_code.co_name)
    return real_cpu(self)


torch.nn.Module.to = recording_to
torch.nn.Module.cpu = recording_cpu
real_loader_init = torch.utils.data.DataLoader.__init__


def recording_loader_init(self, *args, **kwargs):
    record("dataloader", num_workers=kwargs.get("num_workers", 0))
    return real_loader_init(self, *args, **kwargs)


torch.utils.data.DataLoader.__init__ = recording_loader_init

import toolkit.unloader  # noqa: E402  (patched before SDTrainer imports it by name)

real_unload = toolkit.unloader.unload_text_encoder


def recording_unload(model):
    record("te_unloaded")
    return real_unload(model)


toolkit.unloader.unload_text_encoder = recording_unload

import toolkit.host_memory  # noqa: E402

real_trim = toolkit.host_memory._heap_trimmer()


def recording_trim():
    record("heap_trim", caller=sys._getframe(2).f_code.co_name)  # 1: release_freed_memory, 2: its caller
    return real_trim() if real_trim else None


toolkit.host_memory._trimmer = recording_trim

from extensions_built_in.diffusion_models.flux2 import flux2_model  # noqa: E402
from extensions_built_in.sd_trainer import SDTrainer as sd_trainer  # noqa: E402

real_load = flux2_model.Flux2Model.load_model


def recording_load(self):
    real_load(self)
    where["transformer"] = loading["transformer"]
    where["vae"] = next(self.vae.parameters()).device
    for part, module in (("transformer", self.model), ("vae", self.vae)):
        watched.update({id(m): part for m in module.modules()})
    record("placed", **{part: str(device) for part, device in where.items()})


flux2_model.Flux2Model.load_model = recording_load

real_step = sd_trainer.SDTrainer.hook_train_loop


def recording_step(self, batch):
    record("train_step")
    return real_step(self, batch)


sd_trainer.SDTrainer.hook_train_loop = recording_step

sys.argv = ["run.py", CONFIG]
runpy.run_path("run.py", run_name="__main__")
