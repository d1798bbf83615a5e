"""The launchers run where they are launched: without Transformer Engine or apex they add the flags
for Megatron's local implementation and unfused kernels (one line names them), and an explicit
request for a missing package stops before Megatron starts. Also: the local layer spec honours
--normalization (apex's FusedLayerNorm refuses RMSNorm)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from megatron_mok.megatron import fallbacks
from megatron_mok.megatron.fallbacks import MissingPackageError, resolve

REPO = Path(__file__).resolve().parents[2]

TE = (fallbacks.TE_MODULE,)
APEX = (fallbacks.APEX_NORM_MODULE, fallbacks.APEX_GRAD_ACCUM_MODULE, *fallbacks.APEX_SOFTMAX_MODULES)


def probe_missing(*modules: str):
    """A probe that reports `modules` as not importable and everything else as importable."""
    return lambda module: f"ModuleNotFoundError: No module named {module!r}" if module in modules else None


ROPE_RMS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm"]
TINY_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
              "--no-persist-layer-norm"]
ALL_FALLBACKS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
                 "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]

# (case, config argv, command-line argv, missing modules, flags added)
RESOLVED = [
    ("nothing installed, rope + RMSNorm", ROPE_RMS, [], TE + APEX, ALL_FALLBACKS),
    ("nothing installed, config turned rope fusion off", [*ROPE_RMS, "--no-rope-fusion"], [], TE + APEX,
     ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
      "--no-masked-softmax-fusion"]),
    ("nothing installed, learned positions: no rope flag", [], [], TE + APEX,
     ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
      "--no-masked-softmax-fusion"]),
    ("nothing installed, the tiny config sets them all", TINY_FLAGS, [], TE + APEX, []),
    ("explicit local impl is kept, =-form", [], ["--transformer-impl=local"], TE + APEX,
     ["--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]),
    ("TE without apex: the output layer still needs apex's wgrad fusion", ROPE_RMS, [], APEX,
     ["--no-gradient-accumulation-fusion"]),
    ("TE and apex", ROPE_RMS, [], (), []),
    ("apex without TE, RMSNorm: torch RMSNorm refuses persist", ROPE_RMS, [], TE,
     ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm"]),
    ("apex without TE, LayerNorm: apex's norm takes persist", ["--normalization", "LayerNorm"], [], TE,
     ["--transformer-impl", "local"]),
    ("TE present, local impl asked for, no apex", ROPE_RMS, ["--transformer-impl", "local"], APEX,
     ["--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]),
    ("TE present, explicit transformer_engine", [], ["--transformer-impl", "transformer_engine"], APEX,
     ["--no-gradient-accumulation-fusion"]),
]


@pytest.mark.parametrize("case,config,cli,missing,added", RESOLVED, ids=[c[0] for c in RESOLVED])
def test_flags_added_for_what_is_missing(case, config, cli, missing, added):
    resolution = resolve([("configs/x.yaml", config), ("the command line", cli)], probe_missing(*missing))
    assert list(resolution.added) == added, case
    if added:
        assert resolution.message.startswith("megatron_mok: added " + " ".join(added) + " ("), resolution.message
    else:
        assert resolution.message is None


# (case, config argv, command-line argv, text the error must contain)
REFUSED = [
    ("TE impl in the config", ["--transformer-impl", "transformer_engine"], [],
     ["--transformer-impl transformer_engine", "configs/x.yaml", "transformer_engine"]),
    ("TE impl on the command line", [], ["--transformer-impl=transformer_engine"],
     ["--transformer-impl transformer_engine", "the command line", "transformer_engine"]),
    ("command line overrides the config's local", ["--transformer-impl", "local"], ["--transformer-impl", "transformer_engine"],
     ["the command line"]),
    ("FP8 needs TE", [], ["--fp8-format", "hybrid"], ["--fp8-format hybrid", "Transformer Engine"]),
]


@pytest.mark.parametrize("case,config,cli,needles", REFUSED, ids=[c[0] for c in REFUSED])
def test_explicit_request_for_missing_te_is_refused(case, config, cli, needles):
    with pytest.raises(MissingPackageError) as error:
        resolve([("configs/x.yaml", config), ("the command line", cli)], probe_missing(*TE, *APEX))
    for needle in needles:
        assert needle in str(error.value), (case, str(error.value))


def test_added_flags_are_megatron_options_with_the_intended_effect():
    """Every flag `resolve` can add parses with Megatron 0.19's own parser and switches off what
    the table in fallbacks.py says."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    argv = [*ROPE_RMS, *resolve([("c", ROPE_RMS)], probe_missing(*TE, *APEX)).added]
    args, unknown = parser.parse_known_args(argv)
    assert unknown == []
    assert args.transformer_impl == "local"
    assert args.no_persist_layer_norm is True
    assert args.gradient_accumulation_fusion is False
    assert args.masked_softmax_fusion is False
    assert args.apply_rope_fusion is False
    # Megatron's defaults are the other way round (what a bare launch without TE/apex trips on).
    defaults = parser.parse_known_args([])[0]
    assert (defaults.transformer_impl, defaults.no_persist_layer_norm, defaults.gradient_accumulation_fusion,
            defaults.masked_softmax_fusion, defaults.apply_rope_fusion) == ("transformer_engine", False, True, True, True)


def _run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


needs_no_te = pytest.mark.skipif(fallbacks.import_error(fallbacks.TE_MODULE) is None, reason="Transformer Engine is installed")
needs_no_apex = pytest.mark.skipif(
    fallbacks.import_error(fallbacks.APEX_GRAD_ACCUM_MODULE) is None, reason="apex is installed"
)


@needs_no_te
@needs_no_apex
def test_pretrain_trains_a_config_that_leaves_megatrons_te_defaults(tmp_path):
    """The tiny config without its TE/apex flags trains; one line names the flags added."""
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    for key in ("transformer-impl", "no-gradient-accumulation-fusion", "no-masked-softmax-fusion", "no-persist-layer-norm"):
        del config[key]
    path = tmp_path / "tiny_te_defaults.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run("-m", "megatron_mok.pretrain", "--config", str(path), "--train-iters", "2")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("megatron_mok: added")]
    assert lines == [
        "megatron_mok: added --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion"
        " --no-masked-softmax-fusion (no transformer_engine, no apex: Megatron's local implementation and unfused kernels)"
    ], log[-4000:]
    assert log.count(" iteration ") >= 2 and "lm loss:" in log


@needs_no_te
@pytest.mark.parametrize("entry", ["pretrain", "launch"])
def test_explicit_te_without_te_stops_before_megatron(entry, tmp_path):
    script = tmp_path / "never_runs.py"
    script.write_text("print('SCRIPT RAN')\n")
    head = ["-m", "megatron_mok.pretrain"] if entry == "pretrain" else ["-m", "megatron_mok.launch", str(script)]
    result = _run(*head, "--transformer-impl", "transformer_engine", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_mok: --transformer-impl transformer_engine (from the command line) needs"), last
    assert "transformer_engine" in last.split("needs", 1)[1]
    assert "SCRIPT RAN" not in result.stdout and "initializing torch distributed" not in result.stdout


@needs_no_te
def test_launch_adds_the_flags_to_the_script_argv(tmp_path):
    script = tmp_path / "show_args.py"
    script.write_text(
        "from megatron.training.arguments import parse_args\n"
        "a = parse_args()\n"
        "print('ARGS', a.transformer_impl, a.gradient_accumulation_fusion, a.moe_token_dispatcher_type)\n"
    )
    result = _run("-m", "megatron_mok.launch", str(script), "--num-experts", "4", "--moe-token-dispatcher-type", "mok")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ARGS local False mok" in result.stdout
    assert sum(line.startswith("megatron_mok: added") for line in result.stdout.splitlines()) == 1


# --- the layer spec: normalization reaches the local spec ---------------------------------------

def _spec_args(**overrides):
    values = dict(transformer_impl="local", num_experts=8, moe_grouped_gemm=False, qk_layernorm=True,
                  multi_latent_attention=False, normalization="RMSNorm", moe_token_dispatcher_type="mok")
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.mark.parametrize("dispatcher", ["mok", "alltoall"])
def test_local_spec_uses_torch_rmsnorm_even_where_apex_would_be_picked(monkeypatch, dispatcher):
    """With apex installed the local spec's default norm is FusedLayerNorm, which asserts on RMSNorm;
    `layer_spec` must ask for RMSNorm so that Megatron picks its torch norm. Simulated here by
    making FusedLayerNorm the default without apex."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models import backends
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_mok.megatron.gpt_training import layer_spec

    monkeypatch.setattr(backends, "LNImpl", FusedLayerNorm)
    spec = layer_spec(_spec_args(moe_token_dispatcher_type=dispatcher))
    sub = spec.submodules
    assert sub.input_layernorm is WrappedTorchNorm
    assert sub.pre_mlp_layernorm is WrappedTorchNorm
    assert sub.self_attention.submodules.q_layernorm is WrappedTorchNorm


def test_mok_spec_keeps_apex_layernorm_for_layernorm(monkeypatch):
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models import backends

    from megatron_mok.megatron.gpt_training import layer_spec

    monkeypatch.setattr(backends, "LNImpl", FusedLayerNorm)
    assert layer_spec(_spec_args(normalization="LayerNorm")).submodules.input_layernorm is FusedLayerNorm


@pytest.mark.skipif(fallbacks.import_error(fallbacks.TE_MODULE) is not None, reason="needs Transformer Engine")
def test_te_spec_around_mok_experts():
    """With TE the mok spec is TE's layer (fused norm + QKV linear) around MoK's experts."""
    from megatron_mok.megatron.experts import MoKGroupedExperts
    from megatron_mok.megatron.gpt_training import layer_spec

    spec = layer_spec(_spec_args(transformer_impl="transformer_engine"))
    qkv = spec.submodules.self_attention.submodules.linear_qkv
    assert qkv.__name__.startswith("TE"), qkv
    mlp = spec.submodules.mlp
    assert mlp.keywords["submodules"].experts is MoKGroupedExperts


@pytest.mark.parametrize("config", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_parses_with_the_flags_added(config):
    """Each configs/*.yaml, plus whatever the fallbacks add where nothing is installed, is a valid
    Megatron command line (every key an exact option, mok accepted)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mok.arguments import load_config
    from megatron_mok.megatron.register import add_mok_arguments

    parser = add_mok_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    argv = load_config(config)
    argv += resolve([("c", argv)], probe_missing(*TE, *APEX)).added
    args, unknown = parser.parse_known_args(argv)
    assert unknown == [], unknown
    assert args.transformer_impl == "local" and args.moe_token_dispatcher_type == "mok"
