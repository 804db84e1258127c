"""What the launcher and the patched trainer must agree on, in one package both import by name.

The settings catalogue (`settings`), the qtype table (`qtypes`), the memory planner
(`memory_plan`), the quantized cache's file index (`qcache_index`), the safetensors header
reader (`safetensors_header`), the model families (`families`) and the file names both sides
write or read (`files`). The launcher imports it from the repository; `setup` commits the same
files into the trainer checkout beside run.py (upstream.lock `contract:`, with the overlay), so
`verify` reports a checkout whose copy differs and setup rebuilds it.

Standard library only, and nothing here imports the launcher or the trainer:
tests/test_layout.py imports every module in a bare interpreter.
"""
