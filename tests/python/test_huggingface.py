"""Hugging Face transformers models without code changes: `actstash.wrap(model, stash,
mode=...)` finds the decoder layers itself (the model's largest ModuleList), in every
mode and with policy="auto"; the transformers route (`gradient_checkpointing_enable`)
goes through actstash with `actstash.use_for_gradient_checkpointing`. Llama, GPT-2 and
Qwen2 from tiny configs (no weights downloaded), dropout on where the architecture has
it; gradients bitwise equal to the same model without actstash on the same seed, and
the stash's counters show the bytes went to the daemon and came back. Skipped where
transformers is not installed (the pip lanes, scripts/test-pip-torch, have it)."""
import copy
import warnings

import pytest
import torch

import actstash
from actstash_testing.training import assert_bitwise

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

VOCAB, SEQ, BATCH = 128, 32, 2


def tiny(arch):
    """A tiny causal LM of `arch` from a config (random weights, seed 0)."""
    common = dict(vocab_size=VOCAB)
    if arch == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          **common)
    elif arch == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                         resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                         **common)
    else:
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          **common)
    config._attn_implementation = "eager"  # the same kernels with and without actstash
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def step(model, seed, use_cache=None):
    """One training step's gradients (dropout draws from `seed`). use_cache=False runs
    the model without its key/value cache (None: the config's default, on)."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(seed)
    cache = {} if use_cache is None else {"use_cache": use_cache}
    model(input_ids=ids, labels=ids, **cache).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def stash(daemon):
    s = actstash.connect(daemon.socket)
    yield s
    s.close()


def moved(stash, fn):
    """Runs fn(); returns (bytes offloaded, bytes fetched) during it."""
    before = stash.stats()
    out = fn()
    stash.synchronize()
    after = stash.stats()
    return out, (after["bytes_offloaded"] - before["bytes_offloaded"],
                 after["bytes_fetched"] - before["bytes_fetched"])


ARCHS = ["llama", "gpt2", "qwen2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["offload", "checkpoint", "checkpoint+offload"])
def test_wrap_finds_the_decoder_layers(stash, arch, mode):
    model = tiny(arch)
    plain = step(copy.deepcopy(model), 1)
    # A recomputed layer gets no key/value cache (wrap drops it, as transformers does for
    # its own checkpointed layers; a cache filled again by the recomputation would double
    # the keys). The cache can change the arithmetic: with one, attention takes its keys
    # and values from the cache's torch.cat (a contiguous copy, not a transposed view),
    # and GPT-2's gradients under transformers 5.12.1 differ in the last bits from a run
    # without (torch's own checkpoint gives the same bits as actstash's). So a
    # recomputing mode is compared with the model run without a cache, and runs here
    # with the cache on, for wrap to drop.
    expected = plain if mode == "offload" else step(copy.deepcopy(model), 1, use_cache=False)
    actstash.wrap(model, stash, mode=mode, min_bytes=0)  # no blocks=: the decoder layers
    assert all(getattr(b, "_actstash_forward", None) for b in layers(model))
    grads, (offloaded, fetched) = moved(stash, lambda: step(model, 1))
    assert_bitwise(expected, grads)
    if mode == "checkpoint":
        assert offloaded == 0
    else:
        assert offloaded > 0 and fetched == offloaded, (offloaded, fetched)
    assert stash.stats()["live_bytes"] == 0
    actstash.unwrap(model)
    assert_bitwise(plain, step(model, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_plan_chooses_per_decoder_layer(stash, arch):
    model = tiny(arch)
    reference = copy.deepcopy(model)
    actstash.wrap(model, stash, policy="auto", budget="1GiB", min_bytes=0)
    # The plan may recompute some layers (no cache) and keep others (a cache): without
    # a cache on both sides the layers compute alike whatever the plan chose.
    for seed in range(3):  # profile, plan, run the plan
        assert_bitwise(step(reference, seed, use_cache=False), step(model, seed, use_cache=False))
    report = stash.plan()
    assert len(report.choices) == len(layers(model)), report
    names = [c.name for c in report.costs]
    assert all(".0" in names[0] and name.endswith(str(i)) for i, name in enumerate(names)), names
    actstash.unwrap(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_gradient_checkpointing_through_actstash(stash, arch):
    """The route Trainer and accelerate take (gradient_checkpointing_enable), with
    actstash's checkpoint in place of torch's: the layers' inputs are offloaded."""
    model = tiny(arch)
    reference = copy.deepcopy(model)
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    expected = step(reference, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actstash.use_for_gradient_checkpointing(model, stash, min_bytes=0)
    # transformers 5.2x deprecates the gradient_checkpointing_* names (gone in v6):
    # actstash takes the new ones where they exist, so the user sees no warning.
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], \
        [str(w.message) for w in caught]
    assert model.is_gradient_checkpointing
    grads, (offloaded, fetched) = moved(stash, lambda: step(model, 3))
    assert_bitwise(expected, grads)
    hidden = BATCH * SEQ * 64 * 4  # one layer's input, fp32
    assert offloaded >= len(layers(model)) * hidden and fetched == offloaded, (offloaded, fetched)
    model.gradient_checkpointing_disable()
    _, (offloaded, _) = moved(stash, lambda: step(model, 3))
    assert offloaded == 0


def test_trainer_route(stash, tmp_path):
    """transformers' Trainer (over accelerate), 3 steps, with the model prepared by
    use_for_gradient_checkpointing and Trainer's own gradient_checkpointing left off:
    the same parameters as a Trainer run with gradient_checkpointing=True, and the
    layers' inputs went to the daemon and came back."""
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(3))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    def train(model, name, **kw):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2,
            learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", seed=0, dataloader_num_workers=0, **kw)
        transformers.Trainer(model=model, args=args, train_dataset=Data()).train()
        return [p.detach().clone() for p in model.parameters()]

    expected = train(tiny("llama"), "reference", gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": False})
    model = actstash.use_for_gradient_checkpointing(tiny("llama"), stash, min_bytes=0)
    got, (offloaded, fetched) = moved(stash, lambda: train(model, "actstash"))
    assert_bitwise(expected, got)
    hidden = 2 * SEQ * 64 * 4
    assert offloaded >= 3 * len(layers(model)) * hidden and fetched == offloaded


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_offload_adamw_matches_torch_adamw(stash, arch):
    """Adam's states in the pool (actstash.optim.OffloadAdamW), 20 steps with
    clip_grad_norm_ (dropout on in GPT-2): parameters bitwise equal to torch's
    AdamW(foreach=False)."""
    from actstash.optim import OffloadAdamW
    plain, ours = tiny(arch), tiny(arch)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
    opt = OffloadAdamW(ours.parameters(), stash=stash, lr=1e-3)
    assert opt.offloaded_bytes == 2 * sum(p.numel() * 4 for p in ours.parameters())
    for i in range(20):
        for model, optimizer in ((plain, reference), (ours, opt)):
            step(model, seed=i)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    del opt
