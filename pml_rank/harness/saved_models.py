"""An experiment's saved models: the folder `runner.run` trains into (a partial folder named
by host and process id until the experiment completes), and reloading its models, test set
and reference set for users."""

import json
import os
import shutil
import socket
from pathlib import Path

import torch
from pytorch_metric_learning.utils import common_functions as c_f

from .budget import STANDARD_PROTOCOL, digest, training_key
from .datasets import data_root_missing, image_transforms, needs_data_root
from .evaluation import STANDARD_MODEL, test_set_and_folds
from .experiment import STANDARD_CHANNELS, Machine, dataset_of, model_factories, standard_splits, transforms_of


def models_folder(models_dir, budget, row, params, seed):
    """Where `run` keeps an experiment's fold models and record-keeper logs:
    ``<models_dir>/<row>/<digest of budget and params>/seed<k>`` (``:`` in a row name
    becomes ``_``), so experiments of other budgets or parameters never share a folder."""
    setup = digest({"budget": training_key(budget), "params": params})
    return Path(models_dir) / row.replace(":", "_") / setup / f"seed{seed}"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_partial_folder(final):
    """A fresh folder beside `final` for this process to train into (renamed to `final`
    when the experiment completes); removes what dead processes of this host left there."""
    host = socket.gethostname()
    for stale in final.parent.glob(f"{final.name}.partial-{host}-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    partial = final.parent / f"{final.name}.partial-{host}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def load_models(folder, device="cpu"):
    """The models `run` kept in `folder` (a `models_folder`): ``[(trunk, embedder)]``, in
    fold order, each at its best epoch (the models the experiment measured; the standard
    protocol's one model at its last epoch), in eval mode on `device`. Needs no pretrained
    weights: the architecture comes from the folder's ``experiment.json``, the weights from
    its files."""
    folder = Path(folder)
    record = json.loads((folder / "experiment.json").read_text())
    make_trunk, make_embedder = model_factories(record["budget"], record["channels"], load_weights=False)
    standard = record["budget"].get("protocol") == STANDARD_PROTOCOL
    folds = sorted(folder.glob("fold*"), key=lambda path: int(path.name.removeprefix("fold")))
    models = []
    for model_folder in [folder / STANDARD_MODEL] if standard else folds:
        pair = {"trunk": make_trunk(), "embedder": make_embedder() if make_embedder else torch.nn.Identity()}
        # As PML's hooks load the best models after training (`load_latest_saved_models`).
        _, suffix = c_f.latest_version(str(model_folder / "models"), "trunk_*.pth", best=not standard)
        c_f.load_dict_of_models(pair, suffix, str(model_folder / "models"), device, assert_success=True)
        models.append((pair["trunk"].to(device).eval(), pair["embedder"].to(device).eval()))
    return models


def load_test_set(folder, data_root=None, cache_dir=None):
    """The test set of the experiment saved in `folder` (a `models_folder`) exactly as `run`
    evaluated its models: the test classes of the budget's data set, in the same order,
    through the same evaluation transform; items ``(image tensor, label)``, ``labels`` an
    array (the standard protocol's: its query split, retrieved among `load_reference_set`
    on in-shop). A ``folder:`` data set is read from the path the bench recorded, the
    papers' from `data_root`, the glyphs from `cache_dir`. Every image is checked as the
    bench does."""
    budget, machine = _saved_budget(folder, data_root, cache_dir)
    if budget.get("protocol") == STANDARD_PROTOCOL:
        return _saved_standard_splits(budget, machine).query
    data = dataset_of(budget, machine)
    _, test_set = test_set_and_folds(data, budget["num_folds"], transforms_of(budget, data))
    return test_set


def load_reference_set(folder, data_root=None, cache_dir=None):
    """What `load_test_set`'s items were retrieved among when it is another set, in the same
    form: in-shop's gallery on the standard protocol. None where each test item is retrieved
    among the other test items (every other data set and protocol), without loading them."""
    budget, machine = _saved_budget(folder, data_root, cache_dir)
    if budget.get("protocol") != STANDARD_PROTOCOL:
        return None
    return _saved_standard_splits(budget, machine).reference


def _saved_budget(folder, data_root, cache_dir):
    """``(budget, Machine)`` of the experiment saved in `folder`; refuses a papers' data set
    without `data_root`."""
    budget = json.loads((Path(folder) / "experiment.json").read_text())["budget"]
    if needs_data_root(budget["dataset"]) and data_root is None:
        raise data_root_missing(budget["dataset"])
    return budget, Machine(data_root=data_root, cache_dir=cache_dir)


def _saved_standard_splits(budget, machine):
    return standard_splits(budget, machine, image_transforms(budget, STANDARD_CHANNELS))
