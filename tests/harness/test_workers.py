"""Ctrl-C in a claim loop: raised inside the objective, held back while Optuna creates or
records a trial, so no trial is left RUNNING by an interrupt that lands at the wrong moment."""

import os
import signal

import pytest

optuna = pytest.importorskip("optuna")

from pml_rank.harness.workers import InterruptsBetweenTrials  # noqa: E402


def interrupt_this_process():
    os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread before os.kill returns


def test_an_interrupt_inside_the_objective_fails_its_trial_and_stops_the_loop():
    study = optuna.create_study()

    def objective(trial):
        interrupt_this_process()
        return 1.0

    with InterruptsBetweenTrials() as interrupts, pytest.raises(KeyboardInterrupt):
        study.optimize(interrupts.objective(objective), n_trials=1, catch=())
    assert [t.state.name for t in study.trials] == ["FAIL"]


def test_an_interrupt_while_a_trial_is_created_waits_until_it_is_recorded(monkeypatch):
    study = optuna.create_study()
    ask = study.ask

    def ask_interrupted(*args, **kwargs):
        trial = ask(*args, **kwargs)  # the trial is RUNNING in the storage now
        interrupt_this_process()
        return trial

    monkeypatch.setattr(study, "ask", ask_interrupted)
    with InterruptsBetweenTrials() as interrupts:
        # The objective does not run: Optuna records the trial as failed, nothing is left RUNNING.
        with pytest.raises(KeyboardInterrupt):
            study.optimize(interrupts.objective(lambda trial: 1.0), n_trials=1, catch=())
        assert [t.state.name for t in study.trials] == ["FAIL"]
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()  # the loop stops at its next check too


def test_an_interrupt_while_a_result_is_recorded_waits_until_it_is_recorded(monkeypatch):
    study = optuna.create_study()
    record = study._storage.set_trial_state_values

    def record_interrupted(*args, **kwargs):
        interrupt_this_process()
        return record(*args, **kwargs)

    monkeypatch.setattr(study._storage, "set_trial_state_values", record_interrupted)
    with InterruptsBetweenTrials() as interrupts:
        study.optimize(interrupts.objective(lambda trial: 1.0), n_trials=1, catch=())
        assert [t.state.name for t in study.trials] == ["COMPLETE"]
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()


def test_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    with InterruptsBetweenTrials():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
