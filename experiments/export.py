"""Export a checkpoint's GPT parameters as a Hugging Face Llama folder: ``python -m experiments.export <ckpt> <dir>``.

``<ckpt>`` is a checkpoint folder (``.../step_N``) or a checkpoint root (its newest checkpoint is used),
saved by ``shardings.checkpoint.save`` under any layout. Its state must hold the parameters under
``params`` and the model config under ``config``: either the experiment's config (``config.model.config``,
as ``experiments.train`` saves it) or the ``models.gpt.Config`` fields themselves
(``dataclasses.asdict(cfg)``). The folder gets ``model.safetensors`` in the ``LlamaForCausalLM`` layout
(via ``models.gpt.to_hf_llama``) and ``config.json``, so ``LlamaForCausalLM.from_pretrained(dir)`` loads it.
:func:`from_hf_dir` reads such a folder back into ``models.gpt`` parameters (to start training from it).

Exit status: 0 written, 2 bad input (the message names the file or key path and ends with a fix).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import core
import models.gpt as gpt
from core import deferred, tree
from shardings import checkpoint

__all__ = ["export", "from_hf_dir", "main"]

WEIGHTS = "model.safetensors"


def _error(problem: str, fix: str) -> checkpoint.CheckpointError:
    return checkpoint.CheckpointError(f"{problem}. Fix: {fix}.")


def _model_config(values: dict[str, Any], where: str) -> gpt.Config:
    """The ``gpt.Config`` recorded in a checkpoint's JSON values (``{key path: value}``)."""
    fields = {f.name for f in dataclasses.fields(gpt.Config)}
    for prefix in ("['config']['model']['config']", "['config']"):
        found = {p[len(prefix) + 2 : -2]: v for p, v in values.items() if p.startswith(prefix + "['")}
        found = {k: v for k, v in found.items() if k in fields}
        if found:
            name = values.get("['config']['model']['name']", "gpt")
            if name not in ("gpt", "models.gpt"):
                raise _error(f"{where} holds a {name!r} model; only models.gpt exports to Llama", "export a gpt run")
            return gpt.Config(**found)
    raise _error(
        f"{where} records no model config (no ['config']['model']['config'] nor gpt.Config fields under ['config'])",
        "save the state with 'config': dataclasses.asdict(cfg) (experiments.train does this)",
    )


def _params(values: dict[str, Any], cfg: gpt.Config, where: str) -> Any:
    """The ``params`` tree of ``gpt.init``'s structure, filled from the checkpoint's ``['params']...`` tensors."""
    with deferred.deferred():
        recipe = gpt.init(core.random.key(0), cfg)  # structure and shapes only: nothing is computed

    def take(path, leaf):
        key = "['params']" + tree.keystr(path)
        if key not in values:
            raise _error(f"{where} has no {key}", "export a checkpoint of this model (its config and params match)")
        if tuple(values[key].shape) != tuple(leaf.shape):
            raise _error(
                f"{where}: {key} has shape {tuple(values[key].shape)}, the recorded config gives {tuple(leaf.shape)}",
                "export a checkpoint whose config matches its params",
            )
        return values[key]

    return tree.map_with_path(take, recipe)


def export(ckpt: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Write a checkpoint's GPT parameters as a Hugging Face Llama folder; return the folder.

    Args:
        ckpt: a checkpoint folder or root, from ``shardings.checkpoint.save`` (any layout or mesh).
        out_dir: the folder to write ``model.safetensors`` and ``config.json`` into (created).

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: no or a damaged checkpoint, no model config in it, params that do not match it.

    >>> export("runs/gpt/checkpoints", "hf/gpt")  # doctest: +SKIP
    'hf/gpt'
    """
    values, step = checkpoint.load(ckpt)  # one process, whole tensors: {key path: value}
    where = f"checkpoint {os.fspath(ckpt)!r} (step {step})"
    cfg = _model_config(values, where)
    state_dict = gpt.to_hf_llama(_params(values, cfg, where), cfg)
    if cfg.tie_embeddings:
        del state_dict["lm_head.weight"]  # the same tensor as the embedding; transformers re-ties it on load
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(out_dir, WEIGHTS), {"format": "pt"})
    gpt.hf_config(cfg).save_pretrained(out_dir)
    return os.fspath(out_dir)


def from_hf_dir(directory: str | os.PathLike) -> tuple[Any, gpt.Config]:
    """``(params, cfg)`` of ``models.gpt`` from a Hugging Face Llama folder (``config.json`` + safetensors).

    Only ``.safetensors`` weights are read (never a pickle).

    >>> params, cfg = from_hf_dir("hf/gpt")  # doctest: +SKIP
    """
    from transformers import LlamaConfig

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files or not os.path.isfile(os.path.join(directory, "config.json")):
        raise _error(f"{os.fspath(directory)!r} has no config.json and *.safetensors", "pass a folder export() wrote")
    with open(os.path.join(directory, "config.json")) as f:
        cfg = gpt.config_from_hf(LlamaConfig(**json.load(f)))
    state_dict = {k: v for name in files for k, v in load_file(os.path.join(directory, name)).items()}
    if cfg.tie_embeddings:
        state_dict.setdefault("lm_head.weight", state_dict["model.embed_tokens.weight"])
    return gpt.from_hf_llama(state_dict, cfg), cfg


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m experiments.export <checkpoint> <out_dir>``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m experiments.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step_N) or a checkpoint root (newest is used)")
    parser.add_argument("out_dir", help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir)
    except (checkpoint.CheckpointError, ValueError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.join(out, WEIGHTS)} and config.json")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
