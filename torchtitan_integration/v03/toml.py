"""A torchtitan 0.2.2 TOML (and ``--section.key value`` overrides) onto 0.3's config.

0.3 has no TOML: a run is a config function returning a ``Trainer.Config``. The product's
usage stays "``CONFIG_FILE=x.toml ./run_train.sh``", so this module maps a 0.2.2 file onto
:func:`~.configs.seq1f1b_model`'s config (``[model] name`` picks the family). Keys keep their
section and name where 0.3 has them (``parallelism``, ``training`` mostly, ``lr_scheduler``,
``checkpoint``, ``metrics``, ``compile``, ``debug``, ``comm``, ``seq1f1b``); the keys that
moved are in :data:`MOVED`; a key with no home in 0.3 is an error that names it and what to use
instead, never silently dropped. 0.3-native dotted keys (``--dataloader.dataset pycode``) work too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: 0.2.2 key -> 0.3 attribute path (same value, new place)
MOVED = {
    "job.dump_folder": "dump_folder",
    "job.print_config": "debug.print_config",
    "job.save_config_file": "debug.save_config_file",
    "model.hf_assets_path": "hf_assets_path",
    "training.dataset": "dataloader.dataset",
    "training.dataset_path": "dataloader.dataset_path",
    "validation.enable": "validator.enable",
    "validation.freq": "validator.freq",
    "validation.steps": "validator.steps",
    "validation.dataset": "validator.dataloader.dataset",
    "validation.dataset_path": "validator.dataloader.dataset_path",
}
#: 0.2.2 keys that are ours or metadata: read, nothing to set in 0.3
ACCEPTED = {
    "job.config_file": "the file being read",
    "job.custom_config_module": "0.3's Seq1F1BTrainer.Config has the seq1f1b section built in",
    "job.description": "logged at start-up",
    "model.name": "a family of torchtitan_integration.v03.models (checked)",
    "model.flavor": "picks that family's torchtitan model_registry(flavor)",
}
#: 0.2.2 keys without a home in 0.3 -> what to use instead
NO_HOME = {
    "model.tokenizer_path": "put tokenizer.json in hf_assets_path (0.3 reads the tokenizer there)",
    "model.converters": "a config function passing converters to the model's model_registry()",
    "model.print_after_conversion": "--debug.print_config",
    "job.use_for_integration_test": "nothing (0.3 dropped it)",
    "experimental.custom_args_module": "a Trainer.Config subclass (0.3 has no custom args module)",
    "experimental.custom_import": "--module with your own config_registry",
    "training.dataset_type": "a dataloader config in a config function",
    "activation_checkpoint.selective_ac_option": (
        "selective_ac_option = 'op' (0.3's selective AC is op-level) or mode = 'full'; 0.3 has "
        "no every-n-layers option"
    ),
}
_OPTIMIZER_KWARGS = {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay"}


class TomlKeyError(ValueError):
    """A key of the TOML or the command line that 0.3 has no place for."""


def parse_overrides(argv: Iterable[str]) -> dict[str, Any]:
    """``--section.key value`` / ``--section.key=value`` / bare ``--section.key`` (true) /
    ``--section.no_key`` (false), as tyro writes booleans on both torchtitan versions."""
    out: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a:
            raise TomlKeyError(
                f"command-line argument {a!r} is not of the form --section.key value"
            )
        key, _, value = a[2:].partition("=")
        key = key.replace("-", "_")
        if not _:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                section, _, leaf = key.rpartition(".")
                value = not leaf.startswith("no_")
                key = key if value else f"{section}.{leaf[3:]}"
        out[key] = value
        i += 1
    return out


def flatten(toml: Mapping[str, Any]) -> dict[str, Any]:
    """``{"training": {"steps": 5}}`` -> ``{"training.steps": 5}`` (sections one level)."""
    out: dict[str, Any] = {}
    for section, body in toml.items():
        if not isinstance(body, Mapping):
            raise TomlKeyError(f"top-level TOML key {section!r} is not a [section]")
        for key, value in body.items():
            out[f"{section}.{key}"] = value
    return out


def _coerce(value: Any, current: Any, key: str) -> Any:
    """A command-line string as the type of the value it replaces (TOML values are typed)."""
    if not isinstance(value, str) or isinstance(current, str):
        return value
    low = value.lower()
    if isinstance(current, bool) or (current is None and low in ("true", "false")):
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise TomlKeyError(f"{key} = {value!r}: expected true or false")
    for kind in (int, float):
        if isinstance(current, kind) or current is None:
            try:
                return kind(value)
            except ValueError:
                if current is not None:
                    raise TomlKeyError(f"{key} = {value!r}: expected {kind.__name__}") from None
    if isinstance(current, list | tuple) or (current is None and value[:1] in "[{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return [v.strip() for v in value.split(",") if v.strip()]
    if current is None and low in ("none", "null"):
        return None
    return value


def _resolve(config: Any, path: str) -> tuple[Any, str] | None:
    """(object, attribute) of a dotted 0.3 path, or None where it does not exist."""
    *parents, leaf = path.split(".")
    obj = config
    for p in parents:
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, p):
            return None
        obj = getattr(obj, p)
    if not dataclasses.is_dataclass(obj) or leaf not in {f.name for f in dataclasses.fields(obj)}:
        return None
    return obj, leaf


def _set(config: Any, path: str, value: Any, source: str) -> None:
    found = _resolve(config, path)
    if found is None:
        raise TomlKeyError(_no_home(source, path))
    obj, leaf = found
    setattr(obj, leaf, _coerce(value, getattr(obj, leaf), source))


def _no_home(key: str, path: str | None = None) -> str:
    from ..config import RENAMED

    section, _, name = key.partition(".")
    renamed = {f"seq1f1b.{old}": new for old, new in RENAMED.items()}
    if key in renamed:
        return f"[seq1f1b] {name} is now [seq1f1b] {renamed[key]} (the same values): rename it"
    hint = NO_HOME.get(key)
    where = f"[{section}] {name}"
    if hint:
        return f"{where} has no equivalent in torchtitan 0.3; instead: {hint}"
    return (
        f"{where} has no equivalent in torchtitan 0.3's config"
        + (f" (no field {path})" if path and path != key else "")
        + ": remove it, or see `python -m torchtitan_integration.train --help` for the keys "
        "this launcher takes on 0.3"
    )


def _activation_checkpoint(mode: Any) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    modes = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}
    if mode not in modes:
        raise TomlKeyError(
            f"[activation_checkpoint] mode = {mode!r}: use 'none', 'selective' or 'full'"
        )
    return modes[mode]


def _optimizer(opts: Mapping[str, Any], current: Any) -> Any:
    """0.2.2's [optimizer] name/lr/eps/weight_decay as 0.3's one catch-all param group."""
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    group = current.param_groups[0] if current.param_groups else None
    kwargs = dict(group.optimizer_kwargs) if group is not None else {}
    name = opts.get("name", group.optimizer_name if group is not None else "AdamW")
    for key, value in opts.items():
        if key == "name":
            continue
        if key not in _OPTIMIZER_KWARGS:
            raise TomlKeyError(
                f"[optimizer] {key} has no equivalent in torchtitan 0.3's param groups here: "
                f"use one of name, {', '.join(_OPTIMIZER_KWARGS)}"
            )
        kwargs[_OPTIMIZER_KWARGS[key]] = float(value)
    return dataclasses.replace(
        current, param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=str(name),
                                                optimizer_kwargs=kwargs)]
    )  # fmt: skip


def set_rope_length(model: Any, length: int) -> None:
    """``[model] max_seq_len``: the RoPE table's length in every attention layer of a 0.3
    model config. torchtitan's flavors fix it (DeepSeek-V3's at 16,384, its YaRN scaling
    made for 4,096 x 40) and refuse a longer ``seq_len`` at start-up; the table's
    frequencies do not depend on its length, so a longer one only holds more positions."""
    if length < 1:
        raise TomlKeyError(f"[model] max_seq_len = {length} must be >= 1")
    for layer in model.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and getattr(attention, "rope", None) is not None:
            attention.rope = dataclasses.replace(attention.rope, max_seq_len=length)


def build_config(toml_path: str | Path | None, argv: Iterable[str] = ()) -> Any:
    """The 0.3 ``Seq1F1BTrainer.Config`` for a 0.2.2 TOML plus ``--section.key`` overrides."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from .configs import seq1f1b_model

    values: dict[str, Any] = {}
    if toml_path is not None:
        with open(toml_path, "rb") as f:
            values.update(flatten(tomllib.load(f)))
    values.update(parse_overrides(argv))

    name = str(values.pop("model.name", "llama3"))
    flavor = str(values.pop("model.flavor", "debugmodel"))
    try:
        config = seq1f1b_model(name, flavor)
    except ValueError as err:  # an unknown family or flavor, named with the supported ones
        raise TomlKeyError(str(err)) from None
    if "model.max_seq_len" in values:
        set_rope_length(config.model_spec.model, int(values.pop("model.max_seq_len")))
    for key in [k for k in values if k in ACCEPTED]:
        values.pop(key)
    optimizer = {
        k.split(".", 1)[1]: values.pop(k) for k in list(values) if k.startswith("optimizer.")
    }
    if optimizer:
        config.optimizer = _optimizer(optimizer, config.optimizer)
    if values.get("activation_checkpoint.selective_ac_option") == "op":
        values.pop("activation_checkpoint.selective_ac_option")  # what 0.3's SelectiveAC does
    if "activation_checkpoint.mode" in values:
        config.activation_checkpoint = _activation_checkpoint(
            values.pop("activation_checkpoint.mode")
        )
    for key, value in values.items():
        if key in NO_HOME:
            raise TomlKeyError(_no_home(key))
        _set(config, MOVED.get(key, key), value, key)
    config.__post_init__()  # 0.3's own cross-field checks, as after tyro
    return config


#: config subtrees ``--help`` leaves out: the model's internals (``[model] name`` and
#: ``flavor`` pick them) and the [seq1f1b] section (listed on its own)
_NOT_LISTED = {"model_spec", "seq1f1b"}


def options_help(config: Any) -> str:
    """Every ``--section.key`` this launcher accepts on torchtitan 0.3 (the config's fields,
    with their defaults), and the 0.2.2 keys that moved or have no home (``--help``)."""
    lines = ["torchtitan 0.3 options (TOML [section] key = value, or --section.key value):"]

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            if f.name.startswith("_") or f"{prefix}{f.name}" in _NOT_LISTED:
                continue
            value = getattr(obj, f.name)
            if callable(value) and not dataclasses.is_dataclass(value):
                continue  # functions and classes a config function sets, not a TOML key
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{prefix}{f.name}.")
            else:
                shown = repr(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                lines.append(f"  --{prefix}{f.name} (default: {shown})")

    walk(config, "")
    lines.append("0.2.2 keys read in their 0.3 place:")
    lines += [f"  --{old} -> --{new}" for old, new in MOVED.items()]
    lines += [f"  --{key}: {why}" for key, why in ACCEPTED.items()]
    lines.append("0.2.2 keys without a 0.3 equivalent (refused, naming what to use):")
    lines += [f"  --{key}: {hint}" for key, hint in NO_HOME.items()]
    lines.append(
        "activation_checkpoint.mode = 'none' | 'selective' | 'full'; [optimizer] name, "
        + ", ".join(_OPTIMIZER_KWARGS)
    )
    return "\n".join(lines)
