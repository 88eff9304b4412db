"""model(input_ids) returns logits for every family (the staged path, equal to reference_forward).

Shape legend: B batch, S sequence, V vocabulary.
"""

import pith_models
import pytest
import torch

pytestmark = pytest.mark.usefixtures("ops_take_their_torch_path")  # see conftest.py


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v2-tiny", "gpt-oss-tiny"])
def test_calling_the_model_gives_the_reference_logits(name):
    model = pith_models.build(name, "cpu", seed=0)
    ids_BS = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    logits_BSV = model(ids_BS)
    assert logits_BSV.shape == (2, 7, model.cfg.vocab_size)
    torch.testing.assert_close(logits_BSV, model.reference_forward(ids_BS), rtol=1e-5, atol=1e-5)
