from pathlib import Path

import pytest

from qbench.quant.recipe import RecipeError, load_recipe

RECIPES = sorted(p.stem for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml"))


def test_the_required_recipes_ship():
    assert {"fp32", "w8", "w4g128", "w4g64", "w4g128-asym", "w4g128-awq", "w4g128-gptq"} <= set(RECIPES)
    assert {"kv8", "kv4", "k4v2", "w4g128-kv4"} <= set(RECIPES)


def test_kv_recipes_carry_their_scheme():
    assert (load_recipe("kv8").kv.k_bits, load_recipe("kv8").kv.v_bits) == (8, 8)
    assert (load_recipe("k4v2").kv.k_bits, load_recipe("k4v2").kv.v_bits) == (4, 2)
    combined = load_recipe("w4g128-kv4")
    assert combined.weights.bits == 4 and combined.weights.group_size == 128 and combined.kv.k_bits == 4
    assert load_recipe("kv4").weights is None and load_recipe("kv-fp8").kv.scheme == "fp8"


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_loads(name):
    r = load_recipe(name)
    assert r.name == name


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text,fragment", [
    ("name: x\nweights: {bits: 4, group_size: 96}\n", "weights.group_size: 96 is not supported"),
    ("name: x\nweights: {bits: 4, grop_size: 64}\n", "unknown key weights.grop_size"),
    ("name: x\nwieghts: {bits: 4}\n", "unknown key wieghts"),
    ("name: x\nweights: {bits: 3}\n", "weights.bits: 3 is not supported"),
    ("name: x\nweights: {bits: 4, method: smoothquant}\n", "weights.method"),
    ("name: x\nweights: {bits: 4, method: gptq}\ncalibration: {data: evals/data/wikitext-2-raw/wiki.test.raw}\n",
     "test split"),
    ("name: x\ncalibration: {samples: 0}\n", "calibration.samples"),
    ("weights: {bits: 4}\n", "missing string field 'name'"),
    ("name: [unclosed\n", "not valid YAML"),
    ("name: x\nkv: {k_bits: 3, v_bits: 4}\n", "kv.k_bits: 3 is not supported"),
    ("name: x\nkv: {k_bits: 4, v_bitz: 4}\n", "unknown key kv.v_bitz"),
    ("name: x\nkv: {k_bits: 4, residual: 20}\n", "kv.residual: 20 must be a multiple of kv.group"),
    ("name: x\nkv: {scheme: int3}\n", "kv.scheme"),
    ("name: x\nkv: 4\n", "kv must be a mapping"),
])
def test_bad_recipes_name_the_field(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert fragment in str(e.value) and path in str(e.value)
