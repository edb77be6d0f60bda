"""The Hugging Face Llama part of gpu_step_bench.py: actstash beside the offloaders
a transformers user already has (transformers' own checkpoint offload, torchtune's
OffloadActivations), on one model made from a config with random weights.

A peer that cannot run here is a row that says why: transformers missing or
older than the offload keyword, torchtune (or the torchao it imports) missing,
torchtune on the CPU (its OffloadActivations copies on CUDA streams).
"""
import copy
import inspect


def _transformers():
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return None, None, None, "transformers not installed (%s)" % e
    return transformers, LlamaConfig, LlamaForCausalLM, ""


def _torchtune_offload(cuda):
    """torchtune's OffloadActivations class, or (None, why).

    torchtune's package __init__ imports its dataset builders, and so Hugging
    Face datasets and pyarrow (tens of MB, which the GPU kit cannot carry).
    When that import fails, the module that defines OffloadActivations is
    loaded by itself, with torchtune's and torchtune.training's __init__
    skipped: the class measured is torchtune's own, unchanged."""
    if not cuda:
        return None, "needs CUDA (OffloadActivations copies on CUDA streams)"
    try:
        from torchtune.training import OffloadActivations
        return OffloadActivations, ""
    except ImportError as first:
        import importlib
        import importlib.util
        import os
        import sys
        import types
        try:
            spec = importlib.util.find_spec("torchtune")
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            return None, "torchtune not installed (%s)" % first
        for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")]:
            del sys.modules[name]  # what the failed import left half made
        root = os.path.dirname(spec.origin)
        for name, folder in (("torchtune", root), ("torchtune.training",
                                                   os.path.join(root, "training"))):
            package = types.ModuleType(name)
            package.__path__ = [folder]
            sys.modules[name] = package
        try:
            module = importlib.import_module("torchtune.training._activation_offloading")
        except Exception as e:  # torchao missing or of another API: a skip, with why
            return None, "torchtune not importable (%s; then %s: %s)" % (
                first, type(e).__name__, e)
        return module.OffloadActivations, ""


def run_llama_peers(args, torch, actstash, stash, device, dtype, measure, skipped,
                    make_step, offload_context):
    transformers, LlamaConfig, LlamaForCausalLM, why = _transformers()
    names = ["plain", "transformers checkpoint", "transformers ckpt+offload",
             "torchtune offload+ckpt", "actstash offload", "actstash ckpt+offload",
             "actstash via HF checkpoint"]
    if transformers is None:
        for name in names:
            skipped("llama", name, why)
        return
    cuda = device == "cuda"
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim,
                         intermediate_size=(8 * args.dim // 3 + 63) // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                         use_cache=False)
    config._attn_implementation = "eager"  # deterministic backward: bitwise is meaningful
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(device, dtype)
    base.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    step = make_step(lambda model: model(input_ids=ids, labels=ids).loss)

    # transformers 5.2x renamed gradient_checkpointing_* to activation_checkpointing_*
    # (the old names forward **kwargs, so only the new one's signature tells).
    new_names = hasattr(base, "activation_checkpointing_enable")
    enable = "activation_checkpointing_enable" if new_names else "gradient_checkpointing_enable"
    kwargs_name = ("activation_checkpointing_kwargs" if new_names
                   else "gradient_checkpointing_kwargs")

    def hf_checkpoint(model, **extra):
        getattr(model, enable)(**{kwargs_name: {"use_reentrant": False}}, **extra)
        return model

    hf_offload_why = ""
    if "offload" not in inspect.signature(getattr(base, enable)).parameters:
        hf_offload_why = ("transformers %s has no %s(offload=...) (5.17 and later)"
                          % (transformers.__version__, enable))

    def hf_checkpoint_offload(model):
        return hf_checkpoint(model, offload=True)

    tune_offload, tune_why = _torchtune_offload(cuda)

    def tune_context():
        return tune_offload(use_pin_memory=True, use_streams=True)

    variants = [
        ("plain", lambda m: m, None, ""),
        ("transformers checkpoint", hf_checkpoint, None, ""),
        ("transformers ckpt+offload", hf_checkpoint_offload, None, hf_offload_why),
        # torchtune: OffloadActivations around the step, checkpoint per layer.
        ("torchtune offload+ckpt", hf_checkpoint, tune_context, tune_why),
        ("actstash offload", lambda m: m, offload_context, ""),
        ("actstash ckpt+offload",
         lambda m: actstash.wrap(m, stash, mode="checkpoint+offload",
                                 min_bytes=args.min_bytes) or m, None, ""),
        ("actstash via HF checkpoint",
         lambda m: actstash.use_for_gradient_checkpointing(m, stash, min_bytes=args.min_bytes),
         None, ""),
    ]
    reference = None
    for name, prepare, context, why in variants:
        if why:
            skipped("llama", name, why)
            continue
        model = prepare(copy.deepcopy(base))
        got = measure("llama", name, model, context, reference, step=step)
        if reference is None:
            reference = got
        if name == "actstash ckpt+offload":
            actstash.unwrap(model)
        del model
        if cuda:
            torch.cuda.empty_cache()
