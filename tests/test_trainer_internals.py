"""The private transformers/accelerate names `vaswani.trainer_internals` relies on still exist with the signatures it
calls them with; an upgrade that changes one fails here, naming it, before any checkpoint is written unstaged."""

import inspect

from accelerate import Accelerator
from transformers import Trainer

from vaswani.trainer_internals import UPSTREAM_CONTRACT, StagedCheckpoints, check_upstream_contract


def test_the_installed_releases_keep_every_private_name_the_adapter_uses():
    problems = check_upstream_contract()
    assert not problems, "transformers/accelerate changed what vaswani.trainer_internals relies on:\n" + \
        "\n".join(problems)


def test_the_adapter_overrides_only_names_the_contract_checks():
    """A new private override must be added to the contract, or it would go unchecked."""
    private = {name for name, value in vars(StagedCheckpoints).items()
               if name.startswith("_") and not name.startswith("__") and callable(value)}
    assert private <= {name for owner, name in UPSTREAM_CONTRACT if owner is Trainer}


def test_a_changed_signature_a_missing_method_or_property_is_named():
    class Renamed:
        def _save_checkpoint(self, model, trial, metrics):
            pass

        even_batches = property(lambda self: True)  # no setter

    problems = check_upstream_contract({(Renamed, "_save_checkpoint"): ("self", "model", "trial"),
                                        (Renamed, "_get_output_dir"): ("self", "trial"),
                                        (Renamed, "even_batches"): None}, trainer=Renamed)
    assert len(problems) == 4, problems
    assert "Renamed._save_checkpoint now takes ('self', 'model', 'trial', 'metrics')" in problems[0]
    assert "Renamed._get_output_dir no longer exists" in problems[1]
    assert "Renamed.even_batches is no longer a settable property" in problems[2]
    assert "Renamed._save_checkpoint no longer writes into self._get_output_dir(trial)" in problems[3]


def test_the_contract_holds_the_signatures_the_adapter_calls():
    assert tuple(inspect.signature(StagedCheckpoints._save_checkpoint).parameters) == \
        UPSTREAM_CONTRACT[(Trainer, "_save_checkpoint")]
    assert tuple(inspect.signature(StagedCheckpoints._get_output_dir).parameters) == \
        UPSTREAM_CONTRACT[(Trainer, "_get_output_dir")]
    assert (Accelerator, "even_batches") in UPSTREAM_CONTRACT
