"""What the patch series would otherwise insert into the trainer's own files, as named functions.

The patches of both series (patches/amd-fork, patches/upstream-main) whose logic is here keep
to an import of this module and call lines at the place upstream code must change, so that
logic lives once, in the overlay, and the two series differ only where their trainers differ.
Every hook names the patch that calls it.

The module is imported from trainer files that load at very different times (model classes,
the train loop, the dataset); each hook imports the trainer modules it uses when it runs, so
importing flux2_hooks loads only the contract's settings catalogue and file names.
"""

from flux2_contract import files, settings


def load_transformer_streamed(model, transformer, transformer_path: str, place=None) -> None:
    """Fill the meta-device transformer block by block with plain file reads (flux2-stream patch).

    safetensors' load_file maps the whole 64 GB checkpoint and can die without a message.
    Each block is read, cast, quantized (on model_kwargs quantize_device: cpu, or gpu one
    block at a time), put where the LoadPlacement `place` says (default: the CPU) and its
    bf16 tensors released to the OS before the next, so host RAM peaks near one block (plus
    the quantized ones when they are parked or streamed).
    """
    import torch

    from toolkit import memory_budget
    from toolkit.dequantize import patch_dequantization_on_save
    from toolkit.host_memory import release_freed_memory
    from toolkit.streamed_safetensors import load_blockwise
    from toolkit.util.quantize import get_qtype, quantize_extras, quantize_model, quantize_transformer_block

    place = memory_budget.load_placement(None, "cpu") if place is None else place
    dtype = model.torch_dtype
    config = model.model_config
    # an accuracy recovery adapter needs the whole model: quantize at the end
    per_block = config.quantize and config.accuracy_recovery_adapter is None
    device = settings.read(config.model_kwargs, "quantize_device")
    if device not in ("cpu", "gpu"):
        raise ValueError(f"model_kwargs quantize_device must be cpu or gpu, not {device!r}")
    device = model.device_torch if device == "gpu" else torch.device("cpu")
    qtype = get_qtype(config.qtype) if config.quantize else None
    # upstream-main's trainer has quantization exclude patterns; the fork's older base has none
    exclude = {}
    if hasattr(model, "get_quantization_exclude_modules"):
        exclude = {"exclude": model.get_quantization_exclude_modules() or []}
    if config.quantize:
        patch_dequantization_on_save(transformer)

    def on_block(prefix, block):
        if per_block:
            quantize_transformer_block(model, block, qtype, device, name=prefix, place=place(prefix), **exclude)
        release_freed_memory()

    def on_rest(rest):
        if per_block:
            quantize_extras(model, rest, qtype, **exclude)
            place.move_rest(rest)
        release_freed_memory()

    model.print_and_status_update(
        "Streaming transformer" + (" and quantizing block by block" if per_block else "")
    )
    load_blockwise(
        transformer,
        transformer_path,
        model.get_transformer_block_names(),
        on_block=on_block,
        on_rest=on_rest,
        dtype=dtype,
        log=model.print_and_status_update,
    )
    if config.quantize and not per_block:
        model.print_and_status_update("Quantizing Transformer")
        quantize_model(model, transformer)
    elif not config.quantize:
        transformer.to(model.device_torch, dtype=dtype)


def check_flag_files(trainer) -> bool:
    """SAVE_NOW / STOP_NOW in the training folder: save a checkpoint now (flag-files patch).

    The checkpoint holds the weights, optimizer and step, and the flag is deleted. The main
    rank reads the flags and broadcasts them, so every rank saves or stops at the same step.
    True for STOP_NOW, once the progress bar and the logger are closed: the train loop then
    ends the run without the end-of-training sample, save and upload.
    """
    import os

    from toolkit import data_parallel
    from toolkit.print import print_acc

    flags = data_parallel.flags_present(trainer.save_root, (files.SAVE_NOW, files.STOP_NOW), trainer.accelerator.device)
    if not flags:
        return False
    if trainer.progress_bar is not None:
        trainer.progress_bar.pause()
    trainer.save(trainer.step_num)
    trainer.ensure_params_requires_grad()
    for flag in flags if trainer.accelerator.is_main_process else ():
        try:
            os.remove(os.path.join(trainer.save_root, flag))
        except FileNotFoundError:
            pass
    if files.STOP_NOW not in flags:
        print_acc(f"\n{files.SAVE_NOW}: saved checkpoint at step {trainer.step_num}")
        if trainer.progress_bar is not None:
            trainer.progress_bar.unpause()
        return False
    print_acc(f"\n{files.STOP_NOW}: saved checkpoint at step {trainer.step_num}, stopping")
    if trainer.progress_bar is not None:
        trainer.progress_bar.close()
    if trainer.accelerator.is_main_process:
        trainer.logger.finish()
    return True


class UnquantizedLinearError(RuntimeError):
    """A transformer-block Linear could not be quantized."""


def unquantized_linears(model, prefix: str = ""):
    """(name, in_features, out_features) of every Linear whose weight is still a plain tensor."""
    import torch

    from toolkit.util.quantize import Q_MODULES

    return [
        (prefix + name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and m.__class__.__name__ not in Q_MODULES
        and type(m.weight) in (torch.Tensor, torch.nn.Parameter)
    ]


def refuse_unquantized_block_linears(base_model, block, quantization_type, name: str, failures: dict,
                                     exclude=None) -> None:
    """Stop the load when a Linear of transformer block `name` stayed unquantized (fail-loudly patch).

    quantize() only prints per-module errors and a backend may skip a Linear whose input width
    its group size does not divide: that Linear silently stays bf16 and the model no longer
    fits the GPU. `failures` is {block-relative name: why} from the quantizer. Modules the
    model keeps in full precision on purpose (its exclude patterns) are not failures;
    model_kwargs allow_unquantized_block_linears: true lets the run go on with them.
    """
    from fnmatch import fnmatch

    skipped = [
        entry
        for entry in unquantized_linears(block, prefix=f"{name}.")
        if not any(fnmatch(entry[0][len(name) + 1 :], pattern) for pattern in exclude or [])
    ]
    if skipped and not settings.read(
        base_model.model_config.model_kwargs, "allow_unquantized_block_linears"
    ):
        raise UnquantizedLinearError(
            f"{len(skipped)} Linear layer(s) of transformer block {name} could not be "
            f"quantized ({getattr(quantization_type, 'name', quantization_type)}) and would "
            f"silently stay in {base_model.torch_dtype}:\n"
            + "\n".join(
                f"  {n} (in {i}, out {o}): {failures.get(n[len(name) + 1:], 'the backend left it unquantized')}"
                for n, i, o in skipped
            )
            + "\nUse a qtype whose group size divides these widths, or set model_kwargs "
            "allow_unquantized_block_linears: true to train with them unquantized."
        )


def report_unquantized(model, label: str, log=print):
    """Print a summary of the Linears quantization skipped (fail-loudly patch); returns them."""
    skipped = unquantized_linears(model)
    if skipped:
        log(
            f" - {label}: {len(skipped)} Linear layer(s) were not quantized: "
            + ", ".join(f"{n} ({i}->{o})" for n, i, o in skipped[:20])
            + (" ..." if len(skipped) > 20 else "")
        )
    return skipped


def quantize_block_int4_fused(block, exclude=None) -> dict:
    """Replace every nn.Linear of a block (but the excluded) by an Int4Linear (int4_fused patch).

    Returns {name: why} for the ones left alone (an input width the group size does not
    divide), for refuse_unquantized_block_linears to name.
    """
    from fnmatch import fnmatch

    from toolkit.int4_linear import GROUP_SIZE, quantize_linears

    failures = {}

    def fits(name, linear):
        if any(fnmatch(name, pattern) for pattern in exclude or []):
            return False
        if linear.in_features % GROUP_SIZE:
            failures[name] = (
                f"in_features {linear.in_features} is not a multiple of the group size {GROUP_SIZE}"
            )
            return False
        return True

    quantize_linears(block, filter_fn=fits)
    return failures


def get_extensions_process_dict(processes) -> dict:
    """{uid: process class} for the processes a job runs, importing only theirs (extension-jobs patch).

    get_all_extensions_process_dict() imports the process class of every extension (dataset
    tools, slider trainers, generators and their dependencies) when a job runs one. When a process
    sets model_kwargs all_extensions: true, or a named type is not found, it is what this returns.
    """
    from toolkit import extension

    processes = list(processes)
    wanted = {process.get('type') for process in processes}
    if any(settings.read((process.get('model') or {}).get('model_kwargs') or {}, "all_extensions")
           for process in processes):
        return extension.get_all_extensions_process_dict()
    found = {ext.uid: ext for ext in extension.get_all_extensions() if ext.uid in wanted}
    if set(found) != wanted:
        return extension.get_all_extensions_process_dict()
    return {uid: ext.get_process() for uid, ext in found.items()}


def reads_only_caches(datasets, sd) -> bool:
    """Whether every item is a cached latent with no image left to load (dataloader patch).

    An item is then one or two small file reads, done in the trainer's process instead of by
    workers started from it. model_kwargs cached_data_in_process: false keeps the dataset's
    workers. (The fork's older dataset config has no load_image_when_caching_latents.)
    """
    if sd is not None and not settings.read(sd.model_config.model_kwargs, "cached_data_in_process"):
        return False
    extra_images = ('has_control_image', 'has_inpaint_image', 'has_clip_image', 'has_mask_image', 'has_unconditional')
    return all(
        dataset.dataset_config.num_frames <= 1
        and not getattr(dataset.dataset_config, 'load_image_when_caching_latents', False)
        and all(item.is_latent_cached and not any(getattr(item, name, False) for name in extra_images)
                for item in dataset.file_list)
        for dataset in datasets
    )


def quantized_block_device(model):
    """Where each transformer block goes as soon as it is quantized or read from the cache
    (blocks-placed patch).

    The training device when the model will be resident there anyway and nothing else needs
    the device first, so host RAM never holds the whole quantized model; the CPU (the whole
    model parked, then moved once) with layer offloading, while a text encoder still has to
    run on the device (low_vram without a text phase: park_model_for_te_cache), or with
    model_kwargs blocks_to_device: false.
    """
    import torch

    if (
        not settings.read(model.model_config.model_kwargs, "blocks_to_device")
        or model.model_config.layer_offloading
        or model.park_model_for_te_cache
    ):
        return torch.device("cpu")
    return torch.device(model.device_torch)


def stays_placed(model) -> bool:
    """Whether the transformer stays where loading (or the low_vram hand-over) placed it
    (device-states patch).

    The device-state presets of the dataset caches used to send it to the CPU and back (two
    round trips of the whole 4-bit model through host RAM at every launch). Only the trainer's
    BaseModel classes are placed this way; not with layer offloading, whose memory manager owns
    the placement; model_kwargs stay_placed: false restores the round trips.
    """
    from toolkit.models.base_model import BaseModel

    return isinstance(model, BaseModel) and bool(
        settings.read(model.model_config.model_kwargs, "stay_placed")
        and not model.model_config.layer_offloading
    )


def device_state_moves_model(model, device) -> bool:
    """Whether a device state may move the transformer to `device` (device-states patch): always,
    unless it stays placed; then only from the CPU onto an accelerator (a placement the trainer
    deferred)."""
    import torch

    if not stays_placed(model):
        return True
    return torch.device(device).type != "cpu" and model.unet.device.type == "cpu"
