"""The hand-off to ComfyUI (`comfy`, and the LoRA check of `sample`).

workflow (a ComfyUI workflow for the LoRA, edited from ComfyUI's own FLUX.2 [dev] template),
lora_check (will ComfyUI's loader load this LoRA: its tensor names and shapes against the base
checkpoint) and folder (a user's ComfyUI folder: recognise it, place the LoRA, name the models it
lacks). The command itself is `launcher/commands/comfy.py`.
"""
