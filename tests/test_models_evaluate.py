"""Offline evaluation: Fréchet distance, t-bucket losses, memorisation check, the digits
classifier, PNG grids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bagel.models import evaluate as ev
from bagel.models.data import load_dataset
from bagel.protocol.runspec import load_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml"


def test_frechet_distance_matches_the_closed_form_for_gaussians():
    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 1.0, (20_000, 4))
    assert ev.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    # equal covariances: FD is the squared mean shift
    assert ev.frechet_distance(a, a + 3.0) == pytest.approx(4 * 9.0, rel=1e-9)
    # N(0, I) vs N(0, 4 I) in 4 dims: 4 * (1 + 4 - 2 * 2) = 4
    b = rng.normal(0.0, 2.0, (20_000, 4))
    assert ev.frechet_distance(a, b) == pytest.approx(4.0, rel=0.05)
    with pytest.raises(ValueError):
        ev.frechet_distance(a, b[:, :3])


def test_loss_per_bucket_is_deterministic_and_zero_for_the_true_field():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 4, 4, generator=gen)
    # the model that returns 0 scores E|eps - x0|^2 = 2 in every bucket
    zero = lambda xt, t, y: torch.zeros_like(xt)  # noqa: E731
    a = ev.loss_per_bucket(zero, x, None, [0.0, 0.5, 1.0], seed=3)
    assert a == ev.loss_per_bucket(zero, x, None, [0.0, 0.5, 1.0], seed=3)
    assert a == pytest.approx([2.0, 2.0], rel=0.25)
    with pytest.raises(ValueError):
        ev.loss_per_bucket(zero, x, None, [0.5, 0.5])

    # an oracle that knows which data point each x_t came from has zero loss
    class Oracle:
        def __call__(self, xt, t, y):
            return (xt - x) / t.view(-1, 1, 1, 1)

    assert max(ev.loss_per_bucket(Oracle(), x, None, [0.1, 0.6, 1.0], seed=1)) < 1e-8


def test_nearest_distances_flags_copies():
    train = torch.randn(50, 1, 8, 8)
    copies = train[:5].clone()
    assert torch.allclose(ev.nearest_distances(copies, train), torch.zeros(5), atol=1e-5)
    assert float(ev.nearest_distances(train, train, exclude_self=True).min()) > 0


@pytest.mark.timeout(300)
def test_classifier_and_sample_report_on_real_and_copied_digits():
    ds = load_dataset(load_spec(EXAMPLE))
    clf = ev.train_classifier(ds.x_train, ds.y_train, epochs=4, seed=0)
    pred, feats = ev.classify(clf, ds.x_heldout)
    assert float((pred == ds.y_heldout).float().mean()) > 0.85
    assert feats.shape == (len(ds.x_heldout), ev.FEATURES)
    # memorised samples (training images) look perfect on FD but the NN check catches them
    copied = ev.evaluate_samples(ds.x_train[:300], ds.y_train[:300], clf, ds.x_train, ds.x_heldout)
    assert copied.copy_fraction == 1.0 and copied.nn_ratio < 0.01
    real = ev.evaluate_samples(ds.x_heldout, ds.y_heldout, clf, ds.x_train, ds.x_heldout)
    assert real.copy_fraction < 0.1 and real.nn_ratio == pytest.approx(1.0)
    noise = ev.evaluate_samples(torch.rand(300, 1, 8, 8) * 2 - 1, ds.y_train[:300], clf, ds.x_train, ds.x_heldout)
    assert noise.digits_fd > 5 * real.digits_fd and noise.class_acc < 0.5


def test_save_grid_writes_a_png(tmp_path):
    imgs = torch.linspace(-1, 1, 12 * 64).reshape(12, 1, 8, 8)
    path = ev.save_grid(imgs, tmp_path / "sub" / "grid.png", nrow=5, scale=2)
    with Image.open(path) as im:
        assert im.format == "PNG"
        # 3 rows x 5 columns of 8x8 tiles with 1-pixel gaps, scaled 2x
        assert im.size == ((5 * 9 + 1) * 2, (3 * 9 + 1) * 2)
    rgb = ev.save_grid(torch.zeros(2, 3, 4, 4), tmp_path / "rgb.png")
    with Image.open(rgb) as im:
        assert im.mode == "RGB"
