"""The options nanovllm passes to every transformers `from_pretrained`: the checkpoint's own Python
code is never run (a config.json with `auto_map` makes transformers offer to execute the folder's
.py files), and nothing is fetched from the Hugging Face Hub (the README promises no downloads; a
name that is not a local path fails at once instead of after a network timeout)."""

HF_LOCAL_ONLY = {"trust_remote_code": False, "local_files_only": True}
