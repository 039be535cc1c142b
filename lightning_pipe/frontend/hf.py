"""Trained weights out as a Hugging Face directory (config.json + safetensors) that
`AutoModelFor...from_pretrained(dir)` loads in a plain process.

From the trained model itself (the launching process gets it back after `fit`, unless it was
created empty) this is its own `save_pretrained`. From a checkpoint the strategy wrote (a model
created empty is only there): its `state_dict` holds the model's own names under the attribute's
prefix (`model.transformer.wte.weight`), so the model is built on the meta device from its config,
given the checkpoint's tensors as they are (no copy, no random initialisation of a second model),
its tied weights tied again, and saved.

    python -m lightning_pipe.frontend.hf export last.ckpt out/ --config path/to/config_dir
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Union

import torch
from torch import nn

HF_EXTRA = 'pip install "lightning-pipe[hf]"'


def _transformers() -> Any:
    # imported here: the strategy itself runs without transformers
    try:
        import transformers
    except ImportError:
        raise ImportError(f"exporting Hugging Face weights needs transformers: {HF_EXTRA}") from None
    return transformers


def export_pretrained(
    source: Union[nn.Module, str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    config: Any = None,
    *,
    model_class: Any = None,
    prefix: str = "model.",
    max_shard_size: Union[int, str, None] = None,
) -> str:
    """Write `source` to `out_dir` as a Hugging Face model directory; returns `out_dir`.

    `source`: a Hugging Face model (saved as is), or the path of a Lightning checkpoint written by
    the strategy, whose `state_dict` holds the model under `prefix` (the LightningModule attribute
    holding it, e.g. "model." for `self.model`). For a checkpoint, `config`: the model's
    `PretrainedConfig` or a local directory with its config.json; `model_class`: the class to build
    (a `PreTrainedModel` subclass or an `AutoModelFor...` class), default the config's
    `architectures[0]`. `max_shard_size`: as `save_pretrained`'s (default: its own)."""
    out_dir = str(out_dir)
    sharding = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if isinstance(source, nn.Module):
        if not callable(getattr(source, "save_pretrained", None)):
            raise TypeError(f"{type(source).__name__} is not a Hugging Face model (no save_pretrained): pass the model, e.g. module.model")
        if any(t.is_meta for t in [*source.parameters(), *source.buffers()]):
            raise ValueError(
                f"{type(source).__name__} holds no weights here (it was created empty, on the meta device): export the "
                "checkpoint the run wrote instead, export_pretrained('last.ckpt', out_dir, config)"
            )
        source.save_pretrained(out_dir, **sharding)
        return out_dir
    model = _from_checkpoint(str(source), _config(config), model_class, prefix)
    model.save_pretrained(out_dir, **sharding)
    return out_dir


def _config(config: Any) -> Any:
    transformers = _transformers()
    if config is None:
        raise ValueError("exporting a checkpoint needs the model's config: a PretrainedConfig or a directory with its config.json")
    if isinstance(config, transformers.PretrainedConfig):
        return config
    path = str(config)
    if not os.path.exists(path):  # a hub name would be downloaded: only local files are read here
        raise ValueError(f"config={path!r}: no such local file or directory (give the directory holding config.json)")
    return transformers.AutoConfig.from_pretrained(os.path.dirname(path) if os.path.isfile(path) else path)


def _model_class(config: Any, model_class: Any) -> Any:
    if model_class is not None and not isinstance(model_class, str):
        return model_class
    transformers = _transformers()
    name = model_class or next(iter(getattr(config, "architectures", None) or []), None)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(
            f"the config names no model class transformers has (architectures={getattr(config, 'architectures', None)}); "
            "pass model_class, e.g. transformers.AutoModelForCausalLM"
        )
    return cls


def _from_checkpoint(path: str, config: Any, model_class: Any, prefix: str) -> nn.Module:
    if os.path.isdir(path):
        raise ValueError(
            f"{path} is a sharded checkpoint (a directory): make it one file first with "
            "lightning_pipe.lightning.checkpoint.consolidate(path, 'model.ckpt')"
        )
    # memory-mapped: the tensors are read from the file when saved, never all held at once;
    # weights_only=False: a Lightning checkpoint also holds the run's own (non-tensor) state
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    state = {k[len(prefix) :]: v for k, v in checkpoint.get("state_dict", {}).items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{path} holds no state_dict keys starting with {prefix!r}: pass the attribute's prefix (e.g. prefix='net.')")
    cls = _model_class(config, model_class)
    with torch.device("meta"):  # shapes only: every value comes from the checkpoint
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)  # missing: checked once tied, below
    model.tie_weights()  # assign=True put separate tensors in a tied pair's slots: one object again
    empty = [n for n, t in model.state_dict().items() if t.is_meta]
    if empty or unexpected:
        raise ValueError(
            f"{path} does not fit {type(model).__name__}: missing {empty[:3]}, unexpected {sorted(unexpected)[:3]} (prefix={prefix!r})"
        )
    return model.eval()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.frontend.hf", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a checkpoint written by the strategy -> a Hugging Face directory")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--config", required=True, help="local directory holding the model's config.json")
    export.add_argument("--prefix", default="model.", help="the LightningModule attribute holding the model, with a dot")
    export.add_argument("--model-class", default=None, help="e.g. AutoModelForCausalLM (default: the config's architectures[0])")
    args = parser.parse_args(argv)
    out = export_pretrained(args.checkpoint, args.out_dir, args.config, model_class=args.model_class, prefix=args.prefix)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
