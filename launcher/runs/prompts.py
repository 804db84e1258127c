"""The run's own prompt: its dataset's first caption with the trigger word put in as the trainer does.

`sample` (its default prompt list) and `comfy` (the workflow's prompt) both start from it.
"""

from pathlib import Path


def caption_prompt(config: dict) -> str | None:
    """The first non-empty caption of the run's dataset, with the trigger word put in as the trainer does."""
    process = config["config"]["process"][0]
    for dataset in process.get("datasets", []):
        folder = Path(dataset["folder_path"])
        captions = sorted(folder.glob(f"*.{dataset.get('caption_ext', 'txt')}")) if folder.is_dir() else []
        for caption in captions:
            text = caption.read_text(encoding="utf-8").strip()
            if text:
                return with_trigger(text, process.get("trigger_word"))
    return None


def with_trigger(caption: str, trigger: str | None) -> str:
    """`[trigger]` / `[name]` replaced by the trigger word, which leads the prompt when absent."""
    for placeholder in ("[trigger]", "[name]"):
        caption = caption.replace(placeholder, trigger or "")
    caption = " ".join(caption.split())
    return f"{trigger} {caption}" if trigger and trigger not in caption else caption
