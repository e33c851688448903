"""The first guess of a GPU's speed (gpuflex.policy.speeds): nvidia-smi's model names, whole
words only, a host's `speed` over the table, 1.0 for what is not known."""

from __future__ import annotations

import pytest

from gpuflex.policy.speeds import DEFAULT_SPEED, TABLE, same_model, speed_hint, table_speed, words

# (name as nvidia-smi prints it, expected speed relative to a V100)
NAMES = [
    ("NVIDIA H100 80GB HBM3", 5.0),
    ("NVIDIA H100 PCIe", 3.8),
    ("NVIDIA A100-SXM4-80GB", 2.6),
    ("NVIDIA A100-SXM4-40GB", 2.6),
    ("NVIDIA A100-PCIE-40GB", 2.4),
    ("NVIDIA A100 80GB PCIe", 2.4),
    ("Tesla V100-SXM2-16GB", 1.0),
    ("Tesla V100-PCIE-32GB", 1.0),
    ("Tesla T4", 0.3),
    ("NVIDIA GeForce RTX 2080 Ti", 0.75),
    ("NVIDIA GeForce RTX 2080", 0.6),
    ("NVIDIA GeForce RTX 3090", 1.4),
    ("NVIDIA GeForce RTX 3090 Ti", 1.5),
    ("NVIDIA GeForce RTX 4090", 2.0),
    ("NVIDIA RTX A6000", 1.5),
    ("NVIDIA RTX 6000 Ada Generation", 2.3),
    ("Quadro RTX 6000", 0.85),
    ("NVIDIA L40S", 2.5),
    ("NVIDIA L40", 2.0),
    ("NVIDIA L4", 0.7),
    ("NVIDIA A10", 0.9),          # not the A100 it is a prefix of
    ("NVIDIA A40", 1.4),
    ("nvidia geforce rtx 3090", 1.4),   # case does not matter
]


@pytest.mark.parametrize("name,speed", NAMES, ids=[n for n, _ in NAMES])
def test_a_model_name_as_nvidia_smi_prints_it_finds_its_entry(name, speed):
    assert table_speed(name) == speed


@pytest.mark.parametrize("name", [None, "", "NVIDIA Some Future GPU", "AMD Instinct MI250X", "NVIDIA A1000"])
def test_an_unknown_model_has_no_entry(name):
    assert table_speed(name) is None


def test_the_hint_is_the_hosts_speed_then_the_table_then_one():
    assert speed_hint("NVIDIA A100-SXM4-80GB", 7.5) == 7.5     # the host's key wins
    assert speed_hint(None, 0.5) == 0.5                         # a CPU slot host with a speed
    assert speed_hint("NVIDIA A100-SXM4-80GB", None) == 2.6
    assert speed_hint("Mystery GPU", None) == DEFAULT_SPEED == 1.0
    assert speed_hint(None, None) == 1.0


def test_the_a100_is_faster_than_the_3090_which_is_faster_than_the_2080_ti():
    """The issue's lab: a few A100s beside older 2080 Tis and 3090s, in that order."""
    a100, r3090, r2080ti = (table_speed(n) for n in ("NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 3090",
                                                       "NVIDIA GeForce RTX 2080 Ti"))
    assert a100 > r3090 > r2080ti


def test_every_entry_is_positive_and_reachable():
    """No entry is shadowed by a more general one listed before it."""
    for key, speed in TABLE:
        assert speed > 0
        assert table_speed(" ".join(key)) == speed, key


def test_same_model_compares_words_and_never_matches_unknown():
    assert words("NVIDIA A100-SXM4-80GB") == ("NVIDIA", "A100", "SXM4", "80GB")
    assert same_model("NVIDIA A100-SXM4-80GB", "nvidia a100 sxm4 80gb")
    assert not same_model("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB")
    assert not same_model(None, None)
