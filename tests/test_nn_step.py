"""A converted model's step (issue 26): one agreement per layer call, and HaloExchange copies like the other layers."""

from __future__ import annotations

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import HaloExchange  # noqa: E402

from .halo_reference import band, prefix_managers  # noqa: E402


@pytest.mark.mpi(min_size=1)
def test_halo_exchange_module_deepcopies_and_names_state_dict_when_pickled(make_manager):
    """An EMA copy of a model with a HaloExchange shares its manager; pickling it says to save the state_dict()."""
    with prefix_managers(make_manager) as managers:
        for _, manager in managers:
            model = nn.Sequential(HaloExchange(1, manager=manager), nn.Conv2d(2, 2, (3, 1))).double()
            ema = copy.deepcopy(model)
            assert ema[0].manager is manager and ema[1].weight is not model[1].weight
            a, b = band(8, manager)
            x = torch.randn(1, 2, 8, 3, dtype=torch.float64).narrow(2, a, b - a).contiguous()
            torch.testing.assert_close(ema(x), model(x), rtol=0, atol=0)
            for save in (lambda m=model: torch.save(m, io.BytesIO()), lambda m=model: pickle.dumps(m)):
                with pytest.raises(TypeError, match=r"state_dict\(\)"):
                    save()
    pickle.loads(pickle.dumps(HaloExchange(1)))  # no manager (the global one at each call): pickles
