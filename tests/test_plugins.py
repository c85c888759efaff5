"""The plugin system: discovery through entry points, install() into PML's namespaces,
and what happens with broken or clashing plugins."""

import json
import subprocess
import sys
import warnings

import pytest
import pytorch_metric_learning
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners

import pml_rank
from pml_rank import cli
from pml_rank.plugins import KINDS, NameClashWarning, PluginConflictError, PluginWarning

EXAMPLE = "BinomialDevianceLoss"

GOOD_LOSS = """
    import pml_rank
    from pytorch_metric_learning.losses import ContrastiveLoss

    class {name}(ContrastiveLoss):
        pass

    @pml_rank.hookimpl
    def pml_rank_losses():
        return [{name}]
"""


def _load_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        return pml_rank.registry.components()


@pytest.fixture
def uninstall():
    """Removes whatever install() added to PML's namespaces during a test."""
    added = []
    yield added
    for dotted in added:
        module_name, name = dotted.rsplit(".", 1)
        delattr(sys.modules[module_name], name)


def test_builtin_components_come_through_pml_ranks_own_entry_point():
    components = {c.name: c for c in _load_quietly()}
    for kind, module in [("losses", pml_rank.losses), ("samplers", pml_rank.samplers)]:
        for name in module.__all__:
            assert components[name].cls is getattr(module, name)
            assert components[name].kind == kind
            assert components[name].distribution == "pml-rank"
    assert pml_rank.registry.plugin_manager.has_plugin("pml-rank:pml_rank")
    assert not [c for c in components.values() if c.kind == "miners" and c.distribution == "pml-rank"]


def test_example_plugin_is_discovered_with_its_distribution():
    from pml_rank_example import BinomialDevianceLoss

    assert pml_rank.registry.losses()[EXAMPLE] is BinomialDevianceLoss
    (component,) = [c for c in _load_quietly() if c.name == EXAMPLE]
    assert component.distribution == "pml-rank-example"
    assert component.entry_point == "example = pml_rank_example.plugin"


def test_list_command_shows_every_component_kind_and_distribution(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for component in pml_rank.registry.components():
        (line,) = [line for line in out.splitlines() if line.split()[0] == component.name]
        assert line.split()[1:3] == [KINDS[component.kind].singular, component.distribution]


@pytest.mark.slow
def test_console_script_is_installed():
    bin_dir = __import__("pathlib").Path(sys.executable).parent
    result = subprocess.run([bin_dir / "pml-rank", "list"], capture_output=True, text=True, check=True)
    assert EXAMPLE in result.stdout and "pml-rank-example" in result.stdout


def test_install_exposes_components_in_pml_namespaces(uninstall):
    assert not hasattr(pml_losses, EXAMPLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NameClashWarning)  # PML's own FastAPLoss
        report = pml_rank.install()
    uninstall.extend(report["installed"])
    assert f"pytorch_metric_learning.losses.{EXAMPLE}" in report["installed"]
    assert pytorch_metric_learning.losses.BinomialDevianceLoss is pml_rank.registry.losses()[EXAMPLE]
    # Idempotent: a second call installs nothing new.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NameClashWarning)
        assert pml_rank.install()["installed"] == []


def test_install_never_replaces_a_name_pml_defines(fake_distribution, uninstall):
    original = pml_losses.TripletMarginLoss
    fake_distribution("acme-clash", {"acme_clash": GOOD_LOSS.format(name="TripletMarginLoss")}, {"clash": "acme_clash"})
    with pytest.warns(NameClashWarning, match=r"TripletMarginLoss.*acme-clash"):
        report = pml_rank.install()
    uninstall.extend(report["installed"])
    assert "pytorch_metric_learning.losses.TripletMarginLoss" in report["clashes"]
    assert pml_losses.TripletMarginLoss is original
    # Still reachable through the registry.
    import acme_clash

    assert pml_rank.registry.losses()["TripletMarginLoss"] is acme_clash.TripletMarginLoss


def test_a_clashing_name_is_installed_under_its_alias(uninstall):
    from pytorch_metric_learning.losses.fast_ap_loss import FastAPLoss as PMLFastAPLoss

    with pytest.warns(NameClashWarning, match=r"installed as pytorch_metric_learning\.losses\.PMLRankFastAPLoss"):
        report = pml_rank.install()
    uninstall.extend(report["installed"])
    assert "pytorch_metric_learning.losses.FastAPLoss" in report["clashes"]
    assert "pytorch_metric_learning.losses.PMLRankFastAPLoss" in report["installed"]
    assert pml_losses.FastAPLoss is PMLFastAPLoss
    assert pml_losses.PMLRankFastAPLoss is pml_rank.losses.FastAPLoss


@pytest.mark.slow
def test_install_twice_warns_once_per_clash():
    """In a fresh process, as a user meets it: the first call warns once for each name PML
    already has (the aliases are by design), the second call is quiet."""
    code = """if True:
        import json, warnings
        import pml_rank
        calls = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                report = pml_rank.install()
            calls.append({**report, "warnings": [str(w.message) for w in caught]})
        print(json.dumps(calls))
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = json.loads(result.stdout)
    assert "pytorch_metric_learning.losses.CrossBatchMemory" in first["clashes"]
    assert len(first["warnings"]) == len(first["clashes"])
    for dotted, message in zip(first["clashes"], first["warnings"]):
        namespace, name = dotted.rsplit(".", 1)
        assert message.startswith(f"pml-rank: {dotted} already exists") and f"{namespace}.PMLRank{name}" in message
    assert second == {"installed": [], "clashes": first["clashes"], "warnings": []}


def test_install_never_replaces_an_alias_held_by_another_class(uninstall):
    class Foreign(pml_losses.BaseMetricLossFunction):
        pass

    pml_losses.PMLRankFastAPLoss = Foreign
    uninstall.append("pytorch_metric_learning.losses.PMLRankFastAPLoss")
    with pytest.warns(NameClashWarning, match=r"FastAPLoss.*not installed \(.*PMLRankFastAPLoss is .*Foreign too\)"):
        report = pml_rank.install()
    uninstall.extend(report["installed"])
    assert pml_losses.PMLRankFastAPLoss is Foreign
    assert "pytorch_metric_learning.losses.PMLRankFastAPLoss" not in report["installed"]
    assert "pytorch_metric_learning.losses.FastAPLoss" in report["clashes"]
    # Reported once: a second call leaves it alone quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("error", NameClashWarning)
        pml_rank.install()
    assert pml_losses.PMLRankFastAPLoss is Foreign


def test_a_pipeline_building_cross_batch_memory_by_name_gets_ours(uninstall):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NameClashWarning)
        uninstall.extend(pml_rank.install()["installed"])
    # PML's own refuses pml-rank's losses; ours, under the alias, takes them.
    with pytest.raises(Exception, match="not supported"):
        pml_losses.CrossBatchMemory(pml_losses.AUCLoss(), embedding_size=8)
    memory = pml_losses.PMLRankCrossBatchMemory(pml_losses.AUCLoss(), embedding_size=8, memory_size=16)
    assert type(memory) is pml_rank.losses.CrossBatchMemory
    embeddings, labels = torch.randn(8, 8, requires_grad=True), torch.arange(4).repeat(2)
    memory(embeddings, labels).backward()
    assert embeddings.grad.abs().sum() > 0
    assert pytorch_metric_learning.samplers.HierarchicalBatchSampler is pml_rank.samplers.HierarchicalBatchSampler


def test_a_config_pipeline_builds_our_fastap_by_name(uninstall):
    """As powerful-benchmarker does: easy-module-attribute-getter's getter over PML's
    losses module, classes named in YAML; after install() the alias reaches ours."""
    from easy_module_attribute_getter import PytorchGetter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NameClashWarning)
        uninstall.extend(pml_rank.install()["installed"])
    getter = PytorchGetter()
    getter.register("loss", pml_losses)
    ours = getter.get("loss", yaml_dict={"PMLRankFastAPLoss": {"num_bins": 5}})
    assert type(ours) is pml_rank.losses.FastAPLoss and ours.num_bins == 5
    assert type(getter.get("loss", yaml_dict={"FastAPLoss": {}})) is not pml_rank.losses.FastAPLoss
    assert type(getter.get("loss", yaml_dict={"AUCLoss": {"step": 0.01}})) is pml_rank.losses.AUCLoss
    with pytest.raises(TypeError, match="AUCLoss: step must be a number, got the string '1e-2'"):
        getter.get("loss", yaml_dict={"AUCLoss": {"step": "1e-2"}})
    # The getter's own registration: pml-rank's module first, so FastAPLoss is ours.
    getter.register("loss", pml_rank.losses)
    assert type(getter.get("loss", yaml_dict={"FastAPLoss": {}})) is pml_rank.losses.FastAPLoss


def test_third_party_miner_and_sampler_are_registered_and_installed(fake_distribution, uninstall):
    fake_distribution(
        "acme-mining",
        {
            "acme_mining": """
        import pml_rank, torch
        from pytorch_metric_learning.miners import BatchHardMiner

        class AcmeMiner(BatchHardMiner):
            pass

        class AcmeSampler(torch.utils.data.Sampler):
            def __iter__(self):
                return iter([])

        @pml_rank.hookimpl
        def pml_rank_miners():
            return [AcmeMiner]

        @pml_rank.hookimpl
        def pml_rank_samplers():
            return [AcmeSampler]
    """
        },
        {"mining": "acme_mining"},
    )
    import acme_mining

    assert pml_rank.registry.miners()["AcmeMiner"] is acme_mining.AcmeMiner
    assert pml_rank.registry.samplers()["AcmeSampler"] is acme_mining.AcmeSampler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NameClashWarning)
        uninstall.extend(pml_rank.install()["installed"])
    assert pml_miners.AcmeMiner is acme_mining.AcmeMiner
    assert pytorch_metric_learning.samplers.AcmeSampler is acme_mining.AcmeSampler


def test_plugin_that_fails_to_import_warns_and_the_others_load(fake_distribution):
    with pytest.warns(PluginWarning, match=r"'acme-broken'.*'broken = acme_broken'.*import failed.*boom"):
        fake_distribution(
            "acme-broken",
            {"acme_broken": "raise ImportError('boom')", "acme_fine": GOOD_LOSS.format(name="FineLoss")},
            {"broken": "acme_broken", "fine": "acme_fine"},
        )
    losses = pml_rank.registry.losses()
    assert "FineLoss" in losses and EXAMPLE in losses


@pytest.mark.parametrize(
    "body, problem",
    [
        ("return None", r"returned None, not a list of classes"),
        ("return 'NotAList'", r"returned 'NotAList', not a list of classes"),
        ("return [42]", r"returned 42, which is not a subclass of .*BaseMetricLossFunction"),
        ("return [dict]", r"returned <class 'dict'>, which is not a subclass"),
        ("raise RuntimeError('hook exploded')", r"raised RuntimeError: hook exploded"),
    ],
)
def test_hook_returning_garbage_warns_and_the_others_load(fake_distribution, body, problem):
    source = f"""
        import pml_rank

        @pml_rank.hookimpl
        def pml_rank_losses():
            {body}
    """
    with pytest.warns(PluginWarning, match=rf"'acme-garbage'.*'garbage = acme_garbage'.*{problem}"):
        fake_distribution("acme-garbage", {"acme_garbage": source}, {"garbage": "acme_garbage"})
    assert EXAMPLE in pml_rank.registry.losses()


def test_bad_entries_are_skipped_but_good_ones_in_the_same_list_load(fake_distribution):
    source = GOOD_LOSS.format(name="GoodLoss").replace("return [GoodLoss]", "return [GoodLoss, int]")
    with pytest.warns(PluginWarning, match="int"):
        fake_distribution("acme-mixed", {"acme_mixed": source}, {"mixed": "acme_mixed"})
    assert "GoodLoss" in pml_rank.registry.losses()
    assert "int" not in pml_rank.registry.losses()


def test_misspelled_hook_warns(fake_distribution):
    source = GOOD_LOSS.format(name="TypoLoss").replace("def pml_rank_losses", "def pml_rank_loss")
    with pytest.warns(PluginWarning, match=r"'acme-typo'.*pml_rank_loss"):
        fake_distribution("acme-typo", {"acme_typo": source}, {"typo": "acme_typo"})
    assert "TypoLoss" not in pml_rank.registry.losses()


def test_two_plugins_registering_one_name_is_an_error_naming_both(fake_distribution):
    fake_distribution("acme-one", {"acme_one": GOOD_LOSS.format(name="SameLoss")}, {"one": "acme_one"})
    with pytest.raises(PluginConflictError, match=r"SameLoss.*acme-(one|two).*acme-(one|two)") as info:
        fake_distribution("acme-two", {"acme_two": GOOD_LOSS.format(name="SameLoss")}, {"two": "acme_two"})
    assert "acme-one" in str(info.value) and "acme-two" in str(info.value)


def test_loading_imports_only_the_entry_point_modules(fake_distribution):
    fake_distribution(
        "acme-lazy",
        {
            "acme_lazy": "",
            "acme_lazy.plugin": GOOD_LOSS.format(name="LazyLoss"),
            "acme_lazy.heavy": "raise AssertionError('imported a module no entry point names')",
        },
        {"lazy": "acme_lazy.plugin"},
    )
    assert "LazyLoss" in pml_rank.registry.losses()
    assert "acme_lazy.heavy" not in sys.modules


def test_builtin_and_example_plugin_declare_search_spaces():
    import optuna

    spaces = pml_rank.registry.search_spaces()
    for name in ["RaMBORecallLoss", "RaMBOAPLoss", "AUCLoss", "FastAPLoss", "NPairsMCLoss", EXAMPLE]:
        assert name in spaces
    losses = pml_rank.registry.losses()
    for name, space in spaces.items():
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        for _ in range(20):
            trial = study.ask()
            params = space(trial)
            losses[name](**params)  # every suggestion is a valid constructor argument
            assert set(params) <= set(trial.params)
    assert {"lambda_val", "margin", "memory_size", "weighting"} <= set(spaces["RaMBORecallLoss"](study.ask()))


@pytest.mark.parametrize(
    "body, problem",
    [
        ("return [lambda trial: {}]", r"pml_rank_search_spaces\(\) returned \[.*not a dict"),
        ("return {'GoodLoss': 3}", r"the entry 'GoodLoss': 3.*callable space\(trial\)"),
        ("raise RuntimeError('no space')", r"pml_rank_search_spaces\(\) raised RuntimeError: no space"),
    ],
)
def test_search_space_hook_returning_garbage_warns_naming_the_distribution(fake_distribution, body, problem):
    source = (
        GOOD_LOSS.format(name="GoodLoss")
        + f"""
    @pml_rank.hookimpl
    def pml_rank_search_spaces():
        {body}
    """
    )
    with pytest.warns(PluginWarning, match=rf"'acme-spaces'.*'spaces = acme_spaces'.*{problem}"):
        fake_distribution("acme-spaces", {"acme_spaces": source}, {"spaces": "acme_spaces"})
    assert "GoodLoss" in pml_rank.registry.losses()
    assert "GoodLoss" not in pml_rank.registry.search_spaces()
    assert EXAMPLE in pml_rank.registry.search_spaces()


def test_two_plugins_declaring_one_search_space_is_an_error_naming_both(fake_distribution):
    source = """
        import pml_rank

        @pml_rank.hookimpl
        def pml_rank_search_spaces():
            return {{"SharedLoss": lambda trial: {{}}}}
    """
    fake_distribution("acme-one", {"acme_one": source.format()}, {"one": "acme_one"})
    with pytest.raises(PluginConflictError, match=r"SharedLoss.*acme-(one|two).*acme-(one|two)"):
        fake_distribution("acme-two", {"acme_two": source.format()}, {"two": "acme_two"})
