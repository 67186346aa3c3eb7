"""The spectral and energy diagnostics: analytic values, two independent computations of each quantity,
the p = 2 oracle, the model's own attention in every formulation and shape, and the command line on tiny saved
models."""

import json
import math

import pytest
import torch
from tiny import TEXT_SHAPES, text_config, vision_config

from modeling_plat import FORMULATIONS, PlatForCausalLM, PlatForImageClassification
import diagnostics
from diagnostics import energy_rate, euler_direction, hc_dc_ratio, largest_abs_eigenvalue, p_dirichlet_energy
from modeling_plat import PlatImageProcessor
from plat_train.text_data import train_tokenizer


def _random_stochastic(shape, generator):
    return torch.softmax(torch.randn(shape, generator=generator, dtype=torch.float64) * 2, dim=-1)


def test_hc_dc_ratio_of_a_constant_signal_is_zero():
    constant = torch.full((12, 5), 3.7)
    assert hc_dc_ratio(constant).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("offset", [0.5, 0.01])
def test_hc_dc_ratio_of_the_highest_frequency_is_its_analytic_value(offset):
    # z[n] = c + (-1)^n, N even: DC = c * 1 (norm |c| sqrt(N)), HC = (-1)^n (norm sqrt(N)), ratio 1 / |c|.
    alternating = (-1.0) ** torch.arange(16, dtype=torch.float64)
    signal = (offset + alternating)[:, None]  # (N, 1)
    assert hc_dc_ratio(signal).item() == pytest.approx(1 / offset, rel=1e-9)


def test_hc_dc_ratio_by_fft_equals_projection_on_the_dc_vector():
    features = torch.randn(3, 2, 17, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(17, 1, dtype=torch.float64) / math.sqrt(17)  # f_1, the unit DC vector
    dc = ones @ (ones.T @ features)  # projection on f_1, (..., N, D)
    expected = (features - dc).flatten(-2).norm(dim=-1) / dc.flatten(-2).norm(dim=-1)
    torch.testing.assert_close(hc_dc_ratio(features), expected)


def _energy_by_double_loop(features, kernel, p):
    """J = (1/p) sum_{x,y} k(x,y) ||u(y) - u(x)||^p, one head at a time, one pair at a time."""
    heads, tokens = kernel.shape[0], kernel.shape[-1]
    energies = []
    for h in range(heads):
        total = 0.0
        for x in range(tokens):
            for y in range(tokens):
                total += kernel[h, x, y] * torch.linalg.vector_norm(features[h, y] - features[h, x]) ** p[h]
        energies.append(total / p[h])
    return torch.stack(energies)


def test_energy_matches_the_double_loop_for_every_p():
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(3, 7, 4, dtype=torch.float64, generator=generator)  # (H, N, d)
    kernel = _random_stochastic((3, 7, 7), generator)
    p = torch.tensor([1.5, 2.0, 2.5], dtype=torch.float64)
    torch.testing.assert_close(p_dirichlet_energy(features, kernel, p), _energy_by_double_loop(features, kernel, p))


def test_energy_at_p_2_is_the_graph_laplacian_quadratic_form():
    # (1/2) sum k(x,y) ||u_y - u_x||^2 = tr(U^T L U), L the Laplacian of the symmetrised kernel (k + k^T) / 2.
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(2, 9, 5, dtype=torch.float64, generator=generator)
    kernel = _random_stochastic((2, 9, 9), generator).tril()  # causal kernels are not symmetric
    symmetric = (kernel + kernel.transpose(-1, -2)) / 2
    laplacian = torch.diag_embed(symmetric.sum(-1)) - symmetric
    quadratic_form = (features * (laplacian @ features)).sum((-1, -2))
    torch.testing.assert_close(p_dirichlet_energy(features, kernel, 2.0), quadratic_form)


def _symmetric_kernel(shape, generator):
    kernel = _random_stochastic(shape, generator)
    return (kernel + kernel.transpose(-1, -2)) / 2


@pytest.mark.parametrize("p", [1.5, 2.0, 2.5])
def test_on_a_symmetric_kernel_the_euler_direction_is_half_the_negative_gradient(p):
    # With k symmetric, dJ/dv_x = -2 Delta_x (the row and the column part are equal), so the rate along Delta is
    # -2 |Delta|^2 / J: negative, the steepest-descent direction of Theorem 3.4.
    generator = torch.Generator().manual_seed(9)
    features = torch.randn(2, 8, 3, dtype=torch.float64, generator=generator)  # (H, N, d)
    kernel = _symmetric_kernel((2, 8, 8), generator)
    eps = 1e-3
    distances = ((features[:, :, None] - features[:, None, :]) ** 2).sum(-1)
    direction = euler_direction(kernel * (distances + eps) ** ((p - 2) / 2), features)
    energy = p_dirichlet_energy(features, kernel, p, eps)
    expected = -2 * (direction ** 2).sum((-1, -2)) / energy
    torch.testing.assert_close(energy_rate(features, kernel, p, eps, direction), expected)
    assert (expected < 0).all()


def test_a_causal_kernel_can_make_the_euler_direction_ascend():
    # Delta is only the row part of -grad J; with a triangular kernel the column part differs. Here only token 2
    # moves (Delta_2 = 0.8 * (0.9 - 0.6) = 0.24, towards token 0), which takes it away from token 3, who attends
    # to it: dJ/dv_2 = -0.24 + 0.5 * (0.6 + 0.3) = 0.21, so J = 0.441 rises at 0.21 * 0.24 = 0.0504 per unit step.
    features = torch.tensor([[[0.9], [-1.2], [0.6], [-0.3]]], dtype=torch.float64)  # (H=1, N=4, d=1)
    kernel = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.8, 0.0, 0.2, 0.0],
                            [0.0, 0.5, 0.5, 0.0]]], dtype=torch.float64)
    rate = energy_rate(features, kernel, 2.0, 0.0, euler_direction(kernel, features))  # p = 2: W = A
    assert rate.item() == pytest.approx(0.0504 / 0.441)


def test_self_weight_control_and_step_length_of_softmax_and_euler_heads():
    torch.manual_seed(10)
    hidden = torch.randn(2, 17, 24)
    softmax = PlatForImageClassification(vision_config(plap_p=2.0)).eval()
    metrics = diagnostics.attention_diagnostics(softmax.vit.layers[0].attention, hidden)
    # P = 1: nothing to remove, and the off-diagonal row sums of a stochastic matrix stay below 1.
    torch.testing.assert_close(metrics["attention_hc_dc_gain_without_self_weight"], metrics["attention_hc_dc_gain"])
    assert (metrics["max_offdiag_rowsum"] < 1).all()
    euler = PlatForImageClassification(vision_config(plap_p=[1.5, 1.5, 2.5], plap_formulation="euler")).eval()
    metrics = diagnostics.attention_diagnostics(euler.vit.layers[0].attention, hidden)
    torch.testing.assert_close(metrics["attention_hc_dc_gain_without_self_weight"], metrics["attention_hc_dc_gain"])
    paper = PlatForImageClassification(vision_config(plap_p=[1.5, 1.5, 2.5])).eval()
    paper.load_state_dict(euler.state_dict())
    control = diagnostics.attention_diagnostics(paper.vit.layers[0].attention, hidden)
    # The same weights off the diagonal: only the paper formulation's self pair differs, and without it the
    # paper step smooths at least as the row-normalised kernel would allow it to.
    torch.testing.assert_close(control["max_offdiag_rowsum"], metrics["max_offdiag_rowsum"])
    assert not torch.allclose(control["attention_hc_dc_gain"], control["attention_hc_dc_gain_without_self_weight"])


def test_a_row_stochastic_matrix_has_largest_eigenvalue_one():
    attention = _random_stochastic((4, 11, 11), torch.Generator().manual_seed(3))
    torch.testing.assert_close(largest_abs_eigenvalue(attention), torch.ones(4, dtype=torch.float64))


def test_at_p_2_the_effective_matrix_has_the_spectrum_of_softmax_attention():
    torch.manual_seed(4)
    model = PlatForImageClassification(vision_config(plap_p=2.0)).eval()
    hidden = torch.randn(2, 17, 24)
    metrics = diagnostics.attention_diagnostics(model.vit.layers[0].attention, hidden)
    torch.testing.assert_close(metrics["lambda_max_effective"], metrics["lambda_max_softmax"])
    torch.testing.assert_close(metrics["lambda_max_softmax"], torch.ones(3, dtype=torch.float64))


def test_diagnose_reports_every_layer_and_head():
    torch.manual_seed(5)
    model = PlatForCausalLM(text_config()).eval()
    report = diagnostics.diagnose(model, {"input_ids": torch.randint(2, 61, (2, 12)), "use_cache": False})
    assert len(report["hidden_hc_dc_ratio"]) == 3  # embeddings + 2 blocks
    assert [layer["p"] for layer in report["layers"]] == [[1.5, 1.5, 2.5, 2.5]] * 2
    for layer in report["layers"]:
        assert all(len(layer[name]) == 4 for name in diagnostics.PER_HEAD_METRICS)
        # A causal kernel is triangular with A[0, 0] = 1: its spectral radius is exactly 1.
        assert layer["lambda_max_softmax"] == pytest.approx([1.0] * 4)


def _save_classifier(folder, p, seed):
    torch.manual_seed(seed)
    config = vision_config(num_channels=1, image_size=28, patch_size=7, plap_p=p)
    PlatForImageClassification(config).save_pretrained(folder)
    PlatImageProcessor(do_grayscale=True, size={"height": 28, "width": 28}, image_mean=[0.286],
                       image_std=[0.353]).save_pretrained(folder)


def test_command_line_on_tiny_image_models_writes_json_and_pngs(tmp_path):
    _save_classifier(tmp_path / "softmax", 2.0, seed=6)
    _save_classifier(tmp_path / "plat", [1.5, 1.5, 2.5], seed=6)
    out = tmp_path / "out"
    diagnostics.main(["--model", f"baseline={tmp_path / 'softmax'}", "--model", str(tmp_path / "plat"),
                      "--task", "image", "--batch_size", "4", "--out", str(out)])
    report = json.loads((out / "diagnostics.json").read_text())
    assert set(report["models"]) == {"baseline", "plat"}
    assert report["models"]["plat"]["input_shape"] == [4, 1, 28, 28]
    assert len(report["models"]["baseline"]["hidden_hc_dc_ratio"]) == 3
    for name in ("heads.png", "residual_hc_dc.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("shape", TEXT_SHAPES)
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_the_measured_matrices_are_the_models_own_attention(shape, formulation):
    """A, W and M rebuilt from a layer's input are what the layer computes: its output_attentions (the effective M,
    rotary positions and grouped key/value heads included), and W = A * P off the self pairs."""
    torch.manual_seed(11)
    model = PlatForCausalLM(text_config(**TEXT_SHAPES[shape], plap_formulation=formulation)).eval()
    inputs = []
    handles = [layer.attention.register_forward_pre_hook(lambda module, args: inputs.append(args))
               for layer in model.model.layers]
    with torch.no_grad():
        attentions = model(torch.randint(2, 61, (2, 12)), output_attentions=True, use_cache=False).attentions
    for handle in handles:
        handle.remove()
    off = ~torch.eye(12, dtype=torch.bool)
    for layer, args, expected in zip(model.model.layers, inputs, attentions):
        softmax_kernel, weights, effective, _ = diagnostics.head_matrices(layer.attention, args[0], args[1], args[4])
        torch.testing.assert_close(effective, expected)
        if formulation != "selfweight":  # its other tokens keep A: W is the p-Laplacian's, not the step's
            torch.testing.assert_close(torch.where(off, weights, 0.0), torch.where(off, effective, 0.0))
        torch.testing.assert_close(softmax_kernel.sum(-1), torch.ones(2, 4, 12))


def test_self_weight_control_of_the_noself_and_selfweight_formulations():
    torch.manual_seed(12)
    hidden = torch.randn(2, 17, 24)
    mix = [1.5, 1.5, 2.5]
    models = {name: PlatForImageClassification(vision_config(plap_p=2.0 if name == "softmax" else mix,
                                                             plap_formulation=name if name != "softmax" else "paper"))
              for name in ("softmax", "paper", "noself", "selfweight")}
    for model in models.values():
        model.load_state_dict(models["softmax"].state_dict())
    metrics = {name: diagnostics.attention_diagnostics(model.eval().vit.layers[0].attention, hidden)
               for name, model in models.items()}
    # Without its self pair's P, the paper step is the noself step, and the selfweight step is softmax attention.
    torch.testing.assert_close(metrics["paper"]["attention_hc_dc_gain_without_self_weight"],
                               metrics["noself"]["attention_hc_dc_gain"])
    torch.testing.assert_close(metrics["noself"]["attention_hc_dc_gain_without_self_weight"],
                               metrics["noself"]["attention_hc_dc_gain"])
    torch.testing.assert_close(metrics["selfweight"]["attention_hc_dc_gain_without_self_weight"],
                               metrics["softmax"]["attention_hc_dc_gain"])
    # The selfweight step's other tokens keep softmax's weights; the noself step's are the paper's.
    assert (metrics["selfweight"]["max_offdiag_rowsum"] < 1).all()
    torch.testing.assert_close(metrics["noself"]["max_offdiag_rowsum"], metrics["paper"]["max_offdiag_rowsum"])


def test_diagnose_a_llama_shaped_model():
    torch.manual_seed(13)
    model = PlatForCausalLM(text_config(**TEXT_SHAPES["llama"], plap_formulation="selfweight")).eval()
    report = diagnostics.diagnose(model, {"input_ids": torch.randint(2, 61, (2, 12)), "use_cache": False})
    assert report["formulation"] == "selfweight" and len(report["hidden_hc_dc_ratio"]) == 3
    for layer in report["layers"]:
        assert layer["p"] == [1.5, 1.5, 2.5, 2.5]
        assert all(len(layer[name]) == 4 for name in diagnostics.PER_HEAD_METRICS)
        assert layer["lambda_max_softmax"] == pytest.approx([1.0] * 4)
        # Causal: triangular M, whose first token carries the self-weight eps^((p - 2) / 2) alone.
        assert layer["lambda_max_effective"][:2] == pytest.approx([1e-6 ** -0.25] * 2, rel=1e-5)


@pytest.mark.parametrize("shape, formulation", [("gpt2", "euler"), ("llama", "noself")])
def test_command_line_on_a_tiny_language_model_reads_a_text_file(tmp_path, shape, formulation):
    lines = ["the cat sat on the mat", "a dog ran after the cat", "the mat was red"] * 4
    (tmp_path / "text.txt").write_text("\n".join(lines))
    torch.manual_seed(7)
    PlatForCausalLM(text_config(**TEXT_SHAPES[shape], plap_formulation=formulation)).save_pretrained(tmp_path / "lm")
    train_tokenizer(lines, "word").save_pretrained(tmp_path / "lm")
    out = tmp_path / "out"
    diagnostics.main(["--model", str(tmp_path / "lm"), "--task", "text", "--inputs", str(tmp_path / "text.txt"),
                      "--batch_size", "2", "--block_size", "16", "--out", str(out)])
    result = json.loads((out / "diagnostics.json").read_text())["models"]["lm"]
    assert result["formulation"] == formulation and result["input_shape"] == [2, 16]
    assert (out / "heads.png").is_file()


def test_a_transformers_vit_checkpoint_is_measured_as_its_softmax_baseline(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(8)
    config = ViTConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=48,
                       image_size=28, patch_size=7, num_channels=1, num_labels=10)
    ViTForImageClassification(config).save_pretrained(tmp_path / "vit")  # no image processor: the fallback
    diagnostics.main(["--model", str(tmp_path / "vit"), "--task", "image", "--batch_size", "2",
                      "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "diagnostics.json").read_text())["models"]["vit"]
    assert [layer["p"] for layer in result["layers"]] == [[2.0, 2.0, 2.0]] * 2
    for layer in result["layers"]:
        assert layer["lambda_max_effective"] == pytest.approx(layer["lambda_max_softmax"])


def test_summary_by_p_pools_layers_heads_and_seeds_of_one_p():
    def run(energy_rates):
        metrics = {name: [0.0] * 3 for name in diagnostics.PER_HEAD_METRICS}
        return {"layers": [{"p": [1.5, 1.5, 2.5], **metrics, "energy_rate": rates} for rates in energy_rates]}

    results = {"mix/seed1": run([[1.0, 2.0, 10.0], [3.0, 4.0, 20.0]]), "mix/seed2": run([[5.0, 6.0, 30.0]]),
               "softmax": run([[7.0, 8.0, 40.0]])}
    summary = diagnostics.summary_by_p(results)
    assert set(summary) == {"mix", "softmax"} and list(summary["mix"]) == [1.5, 2.5]
    assert summary["mix"][1.5]["energy_rate"] == (3.5, 1.0, 6.0)  # median of 1..6
    assert summary["mix"][2.5]["energy_rate"] == (20.0, 10.0, 30.0)
    assert summary["softmax"][2.5]["energy_rate"] == (40.0, 40.0, 40.0)
