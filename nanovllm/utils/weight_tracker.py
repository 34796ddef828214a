"""What a checkpoint must provide, and whether it did: for every model parameter, the full
(unsharded) checkpoint tensors it is loaded from, by shard id (q/k/v of a fused QKV projection,
gate/up of a fused MLP projection, None for a plain parameter), and their shapes.

`WeightTracker.load` checks each tensor's shape before its weight loader copies it (a copy would
broadcast a one-row LM head over the vocabulary, a narrow would take a prefix of a too-large
tensor), and `check_complete` refuses a checkpoint that left any part of any parameter unloaded.
Every error names the file and the tensor, and both shapes for a mismatch.

Mixture-of-experts models stack their experts' tensors into one parameter per projection
(`expert_params_mapping`, see layers/fused_moe.py); such a parameter counts as loaded piece by piece
(`expert.part`), so one missing expert tensor is named.

A parameter may carry a `checkpoint_view(tensor, shard_id)` that turns its checkpoint tensor into the shape
its loader takes (an fp8 block scale [N/128, K/128] into one row per weight row, layers/fp8.py); the
tensor's stored dtype must then match too: 1-byte (int8, uint8, fp8) tensors load only into parameters
of their own dtype, never cast with their scales dropped."""

import re

import torch
from torch import nn

# A per-expert checkpoint name (`...mlp.experts.3.gate_proj.weight`, its fp8 scale `...weight_scale_inv`, or
# a static checkpoint's activation scale `...gate_proj.input_scale`) or an already stacked one
# (`...mlp.experts.gate_up_proj`, as transformers names GGUF experts).
EXPERT_NAME = re.compile(r"(?P<prefix>.*\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>\w+?)"
                         r"(?:\.weight(?P<suffix>_scale(?:_inv)?)?|\.(?P<input>input_scale))?")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def check_stored_dtype(param: nn.Parameter, tensor: torch.Tensor, name: str, file: str) -> None:
    """A quantized tensor loads only into a parameter of its own dtype, and a quantized parameter only
    from one: a cast would drop or miss the scales, and every output be garbage."""
    quantized = tensor.element_size() == 1 or (param.is_floating_point() and not tensor.is_floating_point())
    if quantized and tensor.dtype != param.dtype:
        raise ValueError(f"{file!r}: tensor {name!r} is stored as {tensor.dtype}, a quantized format "
                         "nanovllm does not implement here (it implements fp8 e4m3 checkpoints whose "
                         "quantization_config says quant_method 'fp8', or 'compressed-tensors' or "
                         "'modelopt' with fp8 weights); use the model's unquantized checkpoint")
    if param.element_size() == 1 and tensor.dtype != param.dtype:
        raise ValueError(f"{file!r}: tensor {name!r} is stored as {tensor.dtype} but the checkpoint's "
                         f"quantization_config makes it {param.dtype}; is config.json this checkpoint's?")


def checkpoint_view(param: nn.Parameter, tensor: torch.Tensor, shard_id, name: str, file: str
                    ) -> torch.Tensor:
    view = getattr(param, "checkpoint_view", None)
    if view is None:
        return tensor
    try:
        return view(tensor, shard_id)
    except ValueError as e:
        raise ValueError(f"{file!r}: cannot load tensor {name!r}: {e}") from e


def checkpoint_shapes(model: nn.Module, name: str, param: nn.Parameter) -> dict:
    """{shard id: full checkpoint shape} of the parameter called `name`."""
    module = model.get_submodule(name.rpartition(".")[0])
    if hasattr(module, "checkpoint_shapes"):
        return module.checkpoint_shapes(param)
    return {None: tuple(param.shape)}


class WeightTracker:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules_mapping", {})
        self.params = dict(model.named_parameters(remove_duplicate=False))
        # A tied LM head is the embedding: the checkpoint's copy (if any) is not loaded twice.
        self.skip = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
        self.experts: dict[str, tuple[str, str]] = getattr(model, "expert_params_mapping", {})
        self.expected = {}
        for name, param in model.named_parameters():  # tied weights appear once
            module = model.get_submodule(name.rpartition(".")[0])
            if hasattr(module, "checkpoint_parts"):  # stacked experts: their loader checks shapes
                self.expected.update({(name, piece): None for piece in module.checkpoint_parts(param)})
            else:
                self.expected.update({(name, shard_id): shape for shard_id, shape
                                      in checkpoint_shapes(model, name, param).items()})
        self.loaded: set[tuple[str, int | str | None]] = set()

    def _target(self, name: str) -> tuple[str, int | str | None]:
        for ckpt_name, (fused_name, shard_id) in self.packed.items():
            if f".{ckpt_name}." in name:
                return name.replace(ckpt_name, fused_name), shard_id
        return name, None

    def _checkpoint_name(self, target: str, shard_id: int | str | None) -> str:
        """The checkpoint's name for one part of a (possibly fused or stacked) parameter."""
        if isinstance(shard_id, str) and "." in shard_id:  # a stacked expert piece: `expert.part`
            expert, part = shard_id.split(".")
            prefix, _, param_name = target.rpartition(".")
            if param_name.endswith("_input_scale"):  # w13_input_scale -> w13, .input_scale
                base, tail = param_name.removesuffix("_input_scale"), "input_scale"
            else:  # w13_weight_scale_inv -> w13, .weight_scale_inv
                base, _, suffix = param_name.partition("_weight")
                tail = f"weight{suffix}"
            proj = next((p for p, mapped in self.experts.items() if mapped == (f"{base}_weight", part)), None)
            return f"{prefix}.{expert}.{proj}.{tail}" if proj else f"{target}:{shard_id}"
        for ckpt_name, (fused_name, fused_shard) in self.packed.items():
            if fused_shard == shard_id and f".{fused_name}." in target:
                return target.replace(fused_name, ckpt_name)
        return target

    def _load_expert(self, match: re.Match, tensor: torch.Tensor, file: str) -> None:
        param_name, part = self.experts[match["proj"]]
        if match["input"]:  # w13_weight -> w13_input_scale
            param_name, suffix = param_name.removesuffix("weight") + "input_scale", ""
        else:
            suffix = match["suffix"] or ""
        target = f"{match['prefix']}.{param_name}{suffix}"
        param = self.params.get(target)
        if param is None:
            return
        expert = None if match["expert"] is None else int(match["expert"])
        check_stored_dtype(param, tensor, match.string, file)
        tensor = checkpoint_view(param, tensor, (expert, part), match.string, file)
        try:
            param.weight_loader(param, tensor, (expert, part))
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{file!r}: cannot load tensor {match.string!r}: {e}") from e
        experts = range(param.shape[0]) if expert is None else (expert,)
        # "gate_up" fills both the gate and the up rows
        self.loaded.update((target, f"{e}.{p}") for e in experts for p in part.split("_"))

    def load(self, name: str, tensor: torch.Tensor, file: str) -> None:
        if name in self.skip:
            return
        match = EXPERT_NAME.fullmatch(name) if self.experts else None
        if match and match["proj"] in self.experts:
            self._load_expert(match, tensor, file)
            return
        target, shard_id = self._target(name)
        param = self.params.get(target)
        if param is None:
            return  # e.g. rotary inv_freq buffers saved by old checkpoints
        key = (target, shard_id)
        shape = self.expected.get(key)
        if shape is None:  # a tied duplicate under another name, or a shard this parameter lacks
            shape = checkpoint_shapes(self.model, target, param).get(shard_id)
        check_stored_dtype(param, tensor, name, file)
        tensor = checkpoint_view(param, tensor, shard_id, name, file)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{file!r}: tensor {name!r} has shape {tuple(tensor.shape)} but the model "
                             f"expects {tuple(shape)}; is this checkpoint the model its config describes?")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{file!r}: cannot load tensor {name!r} of shape {tuple(tensor.shape)}: "
                             f"{e}") from e
        self.loaded.add(key)

    def check_complete(self, source: str) -> None:
        missing = sorted(self._checkpoint_name(target, shard_id)
                         for target, shard_id in self.expected.keys() - self.loaded
                         if target not in self.skip)
        if missing:
            raise ValueError(f"checkpoint {source!r} lacks {len(missing)} tensors the model needs: "
                             f"{missing[:8]}{' ...' if len(missing) > 8 else ''}; is it the model its config "
                             "describes, and are all its files complete?")
