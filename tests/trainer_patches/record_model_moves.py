"""Run the trainer with the training device set to cpu:0 and record what moves the model there.

Used by test_resident_training.py as `<venv python> record_model_moves.py CONFIG EVENTS_JSON`,
from the trainer checkout. cpu:0 is a device distinct from cpu for torch's bookkeeping, so a
move of the transformer "to the GPU" is visible on a CPU-only machine while the run still
trains on the CPU. EVENTS_JSON gets, in order:
  {"event": "model_to_device", "caller": <function that called Flux2.to(cpu:0)>}
  {"event": "te_unloaded"}     the text encoder is cached and unloaded
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


def record(event, **fields):
    events.append({"event": event, **fields})
    with open(EVENTS, "w", encoding="utf-8") as f:
        json.dump(events, f)


accelerate.Accelerator.device = property(lambda self: DEVICE)
real_to = torch.nn.Module.to


def recording_to(self, *args, **kwargs):
    if type(self).__name__ == "Flux2":
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))]
        if any(torch.device(t) == DEVICE for t in targets):
            record("model_to_device", caller=sys._getframe(1).f_code.co_name)
    return real_to(self, *args, **kwargs)


torch.nn.Module.to = recording_to

import toolkit.unloader  # noqa: E402  (patched before SDTrainer imports it by name)

real_unload = toolkit.unloader.unload_text_encoder


def recording_unload(model):
    record("te_unloaded")
    return real_unload(model)


toolkit.unloader.unload_text_encoder = recording_unload

from extensions_built_in.sd_trainer import SDTrainer as sd_trainer  # noqa: E402

real_step = sd_trainer.SDTrainer.hook_train_loop


def recording_step(self, batch):
    record("train_step")
    return real_step(self, batch)


sd_trainer.SDTrainer.hook_train_loop = recording_step

sys.argv = ["run.py", CONFIG]
runpy.run_path("run.py", run_name="__main__")
