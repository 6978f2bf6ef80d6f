from pathlib import Path

import pytest

from qbench.quant.recipe import RecipeError, load_recipe

RECIPES = sorted(p.stem for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml"))


def test_the_required_recipes_ship():
    assert {"fp32", "w8", "w4g128", "w4g64", "w4g128-asym", "w4g128-awq", "w4g128-gptq"} <= set(RECIPES)


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
])
def test_bad_recipes_name_the_field(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert fragment in str(e.value) and path in str(e.value)
