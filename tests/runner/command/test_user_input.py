"""What a user types, refused before anything is composed or trained: a YAML file of theirs that
is not YAML, is empty, does not start from gacli's defaults, sets a key nothing reads or one key
twice, or sets a config group as a key; command-line keys nothing reads; --cfg beside -m. Each is
one paragraph, exit code 2, no traceback and no run directory left behind. --cfg refuses what a
run refuses; the keys of a user's own target stay open, and a config= that is also a shipped
recipe's name says which file it took."""

import pytest

from helpers import assert_refused, first_error_line, ga_train

YAML_CASES = {
    "syntax.yaml": (
        "defaults: [/train, _self_]\naccum_steps: [1\n",
        "ga-train: ./syntax.yaml:2:14: not valid YAML (while parsing a flow sequence",
    ),
    "tab.yaml": (
        "defaults: [/train, _self_]\n\tepochs: 2\n",
        "ga-train: ./tab.yaml:2:1: not valid",
    ),
    "empty.yaml": (
        "",
        "ga-train: config=./empty.yaml is empty; a ga-train config starts from "
        "gacli's defaults with these lines:\ndefaults:\n  - /train\n  - _self_",
    ),
    "nodefaults.yaml": (
        "accum_steps: 2\n",
        "ga-train: config=./nodefaults.yaml does not start from gacli's defaults",
    ),
    "unknown.yaml": (
        "defaults: [/train, _self_]\noptimizer:\n  learnig_rate: 0.1\n",
        "ga-train: config=./unknown.yaml: optimizer.learnig_rate is not a key "
        "ga-train reads, so setting it would change nothing; did you mean "
        "optimizer.learning_rate?",
    ),
    # Two batch keys set, the default job's accum_steps: 4 left in place.
    "no_null.yaml": (
        "defaults: [/train, _self_]\nmicro_batch_size: 16\neffective_batch_size: 256\n",
        "Set the one to derive to null in your YAML, e.g. accum_steps: null (then "
        "accum_steps = 16)",
    ),
    "group_by_name.yaml": (
        "defaults: [/train, _self_]\ndataset: {name: image_folder}\n",
        "'- override /dataset: image_folder' to the defaults list",
    ),
}


@pytest.mark.parametrize("name", sorted(YAML_CASES))
def test_a_users_yaml_is_checked_before_composition(name, tmp_path):
    content, first_line = YAML_CASES[name]
    (tmp_path / name).write_text(content)
    code, output = ga_train(f"config=./{name}", cwd=tmp_path)
    assert_refused(code, output, first_line, tmp_path)


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            "epochs: 2\naccum_steps: 2\nepochs: 3\n",
            "ga-train: ./my.yaml:6:1: the key 'epochs' is given twice (the first would be "
            "ignored); keep one of the two lines",
        ),
        (
            "optimizer:\n  learning_rate: 0.1\n  learning_rate: 0.2\n",
            "ga-train: ./my.yaml:6:3: the key 'learning_rate' is given twice",
        ),
        (
            "precision: mixed_bfloat16\n",
            "ga-train: config=./my.yaml sets precision: mixed_bfloat16, but precision is a config "
            "group, chosen in the defaults list: add '- override /precision: mixed_bfloat16'",
        ),
    ],
)
def test_a_users_yaml_with_a_key_twice_or_a_group_as_a_key(tmp_path, body, expected):
    (tmp_path / "my.yaml").write_text("defaults:\n  - /train\n  - _self_\n" + body)
    code, output = ga_train("config=./my.yaml", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(expected), output


OVERRIDE_CASES = [
    (["+foo=1"], "ga-train: +foo=1: foo is not a key ga-train reads"),
    (["+model.widht=3"], "ga-train: model.widht is not a key ga-train reads with model=mlp"),
    (
        ["acum_steps=4"],
        "ga-train: acum_steps=4: acum_steps is not a key ga-train reads, so "
        "setting it would change nothing; did you mean accum_steps?",
    ),
    # Hydra's own composition errors are input errors too: exit code 2.
    (["accum_steps=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["model=transformerz"], "Could not find 'model/transformerz'"),
]


@pytest.mark.parametrize(
    "arguments, first_line", OVERRIDE_CASES, ids=[case[0][0] for case in OVERRIDE_CASES]
)
def test_keys_nothing_reads_are_refused(arguments, first_line, tmp_path):
    code, output = ga_train(*arguments, cwd=tmp_path)
    assert_refused(code, output, first_line, tmp_path)


def test_free_form_keys_stay_open(tmp_path):
    # A model of one's own takes any argument (its signature is checked when it is called).
    code, output = ga_train(
        "--cfg", "job", "model._target_=my_pkg.nets.Net", "model.width=3", cwd=tmp_path
    )
    assert code == 0 and "width: 3" in output, output


def test_a_shipped_recipe_name_says_which_file_it_took(tmp_path):
    (tmp_path / "unet.yaml").write_text("defaults: [/train, _self_]\nepochs: 1\n")
    code, output = ga_train("config=unet.yaml", "--cfg", "job", cwd=tmp_path)
    assert code == 0 and "config=./unet.yaml takes the file" in output, output
    code, output = ga_train("config=./unet.yaml", "--cfg", "job", cwd=tmp_path)
    assert code == 0 and "epochs: 1" in output and "takes the file" not in output, output


REFUSED = (
    "ga-train: effective_batch_size=100 is not a multiple of accum_steps x replicas = 3 x 1 = 3"
)


@pytest.mark.parametrize("shown", ["job", "all"])
def test_printing_the_config_refuses_what_a_run_refuses(tmp_path, shown):
    code, output = ga_train(
        "accum_steps=3", "effective_batch_size=100", "--cfg", shown, cwd=tmp_path
    )
    assert code == 2 and "Traceback" not in output, output
    assert output.startswith(REFUSED), output
    assert "micro_batch_size:" not in output, "refused before the config is printed"
    code, output = ga_train(
        "accum_steps=4", "effective_batch_size=100", "--cfg", "job", cwd=tmp_path
    )
    assert code == 0 and "effective_batch_size: 100" in output, output


def test_a_sweep_cannot_show_its_config(tmp_path):
    # Hydra refused the pair with a ValueError and a traceback.
    code, output = ga_train("-m", "accum_steps=1,2", "--cfg", "job", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert first_error_line(output).startswith(
        "ga-train: -m cannot be combined with --cfg: Hydra shows the config"
    ), output
