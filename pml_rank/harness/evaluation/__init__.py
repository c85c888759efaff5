"""The Reality Check evaluation protocol (Musgrave et al., ECCV 2020) and the older papers'
standard protocol, with PML's own trainer, tester, hooks and `AccuracyCalculator`.

    from pml_rank.harness.evaluation import Recipe, run_protocol, summarize
    config = TrainingConfig.from_budget(budget.resolve("glyphs"))
    result = run_protocol(dataset, Recipe(make_loss=losses.TripletMarginLoss), make_trunk, config)

Building blocks, usable on their own:
    class_disjoint_split, cross_validation_folds, class_partitions, LabelledSubset   (splits)
    accuracy, concatenate, concatenated_and_separated, mean_and_ci, METRICS, PML_NAMES (metrics)
    TrainingConfig, train_model, compute_embeddings, make_record_keeper, default_sampler         (training)
"""

from .metrics import METRICS, PML_NAMES, SHORT_NAMES, accuracy, concatenate, concatenated_and_separated, mean_and_ci
from .protocol import (
    STANDARD_MODEL,
    ProtocolResult,
    Recipe,
    StandardSplits,
    raw_input_accuracy,
    run_protocol,
    run_standard_protocol,
    summarize,
    test_set_and_folds,
    train_fold_model,
)
from .splits import LabelledSubset, class_disjoint_split, class_partitions, cross_validation_folds
from .training import (
    TrainingConfig,
    TrainResult,
    compute_embeddings,
    default_sampler,
    make_record_keeper,
    make_tester,
    quiet_pml,
    seed_everything,
    train_model,
)

__all__ = [
    "METRICS",
    "PML_NAMES",
    "SHORT_NAMES",
    "STANDARD_MODEL",
    "LabelledSubset",
    "ProtocolResult",
    "Recipe",
    "StandardSplits",
    "TrainingConfig",
    "TrainResult",
    "accuracy",
    "class_disjoint_split",
    "class_partitions",
    "compute_embeddings",
    "concatenate",
    "concatenated_and_separated",
    "cross_validation_folds",
    "default_sampler",
    "make_record_keeper",
    "make_tester",
    "mean_and_ci",
    "quiet_pml",
    "raw_input_accuracy",
    "run_protocol",
    "run_standard_protocol",
    "seed_everything",
    "summarize",
    "test_set_and_folds",
    "train_fold_model",
    "train_model",
]
