"""Chat fine-tuning: conversations rendered by a model folder's own chat template (training/chat.py, in
Jinja2's sandbox), prepared with a loss mask on the assistant's tokens (tools/prepare.py --chat), trained
under any layout as one device, and answered with the template (tools/sample.py --chat).

The tokenizer and the template are made here, nothing downloaded: a byte-level BPE with ChatML's special
tokens and a template written as Qwen3's is (an empty reasoning block before the last answer, none before
earlier ones: earlier turns render differently once later ones follow), so the assistant's turns are found
in the whole conversation, not by rendering prefixes. gpt-oss's harmony template is the one its folder ships
(tests/templates/gpt_oss.jinja), with a tokenizer made here that has harmony's special tokens; Gemma 3's is
gemma-3-1b-it's (tests/templates/gemma3.jinja), with a SentencePiece-like tokenizer that has Gemma's.
"""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

import train
from distributed import run_on_ranks
from model import GPT, GPTConfig, document_ids
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from test_prepare import WORDS, model_folder, training_text
from tools import prepare, sample
from training import chat as chat_lib
from training import cli
from training.chat import ChatError, ChatTemplate
from training.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role in ['system', 'user', 'assistant'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "good bye"}]


def byte_level_bpe(specials):
    """A byte-level BPE tokenizer (Qwen's and gpt-oss's kind) of 400 ids trained on training_text(), with
    these special tokens first."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.train_from_iterator(training_text(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return backend


def chat_folder(path, template=QWEN3_LIKE):
    """A model folder's tokenizer files as a Qwen3 chat model has them: <|im_end|> ends a generation (the
    EOS), <|endoftext|> pads, and tokenizer_config.json holds the template."""
    backend = byte_level_bpe(SPECIALS)
    end, pad = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
    return str(model_folder(path, backend, generation_config=dict(eos_token_id=[end, pad]),
                            tokenizer_config=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                  chat_template=template)))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_folder(tmp_path_factory.mktemp("chat") / "model")


def test_a_conversation_renders_and_counts_the_assistants_turns_alone(folder):
    """The text is the template's; the tokens the loss counts are the two answers, each with its end-of-turn
    token (the last with its empty reasoning block, as Qwen3 trains its answers); nothing else."""
    template = ChatTemplate.from_folder(folder, Tokenizer.from_folder(folder))
    pieces = [("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
               "<|im_start|>assistant\n", False),
              ("hello<|im_end|>", True),
              ("\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n", False),
              ("<think>\n\n</think>\n\ngood bye<|im_end|>", True),
              ("\n", False)]
    text, _ = template.assistant_spans(CONVERSATION)
    assert text == "".join(piece for piece, _ in pieces)
    ids, counted = template.encode(CONVERSATION)
    _, offsets = template.tokenizer.encode_rendered(text)
    assert counted_runs(template, CONVERSATION) == pieces
    backend = template.tokenizer.backend
    assert [ids[i] for i, c in enumerate(counted) if c and text[offsets[i][0]:offsets[i][1]] == "<|im_end|>"] \
        == [backend.token_to_id("<|im_end|>")] * 2  # special tokens' names are those tokens
    assert template.prompt_ids(CONVERSATION[:2]) == template.tokenizer.encode_rendered(pieces[0][0])[0]
    # Conversations are separated by the first end the template never writes: <|endoftext|>, not <|im_end|>
    assert template.document_end(chat_lib.end_ids(folder, template.tokenizer)) == backend.token_to_id("<|endoftext|>")


def counted_runs(template, messages):
    """[(text, counted)] of each run of the conversation's tokens that the loss counts alike."""
    text, _ = template.assistant_spans(messages)
    _, offsets = template.tokenizer.encode_rendered(text)
    runs = []
    for (first, end), count in zip(offsets, template.encode(messages)[1]):
        if runs and runs[-1][1] == count:
            runs[-1][0] += text[first:end]
        else:
            runs.append([text[first:end], count])
    return [tuple(run) for run in runs]


# gpt-oss: the harmony format, rendered by the template openai/gpt-oss-20b's folder ships
HARMONY = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
           "<|constrain|>"]
GPT_OSS_TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "gpt_oss.jinja")


def harmony_folder(path):
    """A model folder's tokenizer files as gpt-oss's are: harmony's special tokens, generation ending at
    <|return|>, <|endoftext|> or <|call|> (generation_config.json's order), <|endoftext|> padding, and the
    template in chat_template.jinja."""
    backend = byte_level_bpe(HARMONY)
    ends = [backend.token_to_id(name) for name in ("<|return|>", "<|endoftext|>", "<|call|>")]
    folder = model_folder(path, backend, generation_config=dict(eos_token_id=ends),
                          tokenizer_config=dict(eos_token="<|return|>", pad_token="<|endoftext|>"))
    with open(GPT_OSS_TEMPLATE, encoding="utf-8") as f:
        (folder / "chat_template.jinja").write_text(f.read())
    return str(folder)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return harmony_folder(tmp_path_factory.mktemp("harmony") / "gpt-oss")


def harmony_system(template):
    """What the harmony template writes first, whatever the conversation: its system message."""
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            "Knowledge cutoff: 2024-06\n"
            f"Current date: {template.loaded_at:%Y-%m-%d}\n\n"
            "Reasoning: medium\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>")


@pytest.mark.parametrize("thinking", [False, True], ids=["answer", "reasoning-and-answer"])
def test_gpt_oss_harmony_counts_the_last_answer_through_its_return(harmony, thinking):
    """The loss counts what gpt-oss writes after the generation prompt <|start|>assistant in the last turn:
    with `thinking`, its analysis message, <|end|>, and the final channel's header; the answer; <|return|>.
    An earlier answer is written as the model reads it in a later turn (the final channel alone, its
    reasoning dropped, ended by <|end|>, at which generation does not stop): it does not count."""
    template = ChatTemplate.from_folder(harmony, Tokenizer.from_folder(harmony))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello", "thinking": "a greeting"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "good bye"}]
    if thinking:
        messages[-1]["thinking"] = "they leave"
    last = ("<|channel|>analysis<|message|>they leave<|end|><|start|>assistant" if thinking else "") \
        + "<|channel|>final<|message|>good bye<|return|>"
    pieces = [(harmony_system(template) + "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n<|end|>"
               "<|start|>user<|message|>hi there<|end|>"
               "<|start|>assistant<|channel|>final<|message|>hello<|end|>"
               "<|start|>user<|message|>bye<|end|><|start|>assistant", False),
              (last, True)]
    assert template.render(messages) == "".join(piece for piece, _ in pieces)
    assert counted_runs(template, messages) == pieces
    ids, counted = template.encode(messages)
    backend = template.tokenizer.backend
    special = {backend.token_to_id(name): name for name in HARMONY}
    assert [special[i] for i, c in zip(ids, counted) if c and i in special] == \
        (["<|channel|>", "<|message|>", "<|end|>", "<|start|>"] if thinking else []) + \
        ["<|channel|>", "<|message|>", "<|return|>"]  # special tokens' names are those tokens
    # the prompt a reply is sampled from ends with the generation prompt; the reply ends at <|return|>
    assert template.render(messages[:4], add_generation_prompt=True) == pieces[0][0]
    assert template.end_of_turn == "<|return|>"
    assert template.end_of_turn_id() == backend.token_to_id("<|return|>")
    # conversations are separated by <|endoftext|>: the first of the ends the template never writes
    assert chat_lib.end_ids(harmony, template.tokenizer)[:2] == [backend.token_to_id("<|return|>"),
                                                                backend.token_to_id("<|endoftext|>")]
    assert template.document_end(chat_lib.end_ids(harmony, template.tokenizer)) == backend.token_to_id("<|endoftext|>")
    with pytest.raises(ChatError, match="ends no assistant turn of the conversation with '<\\|return\\|>'"):
        template.encode(messages[:4])  # its answer is written as context: nothing would be trained


def test_prepare_chat_with_the_harmony_template(harmony, tmp_path):
    """python -m tools.prepare --chat with gpt-oss's template: each conversation's counted tokens are one run,
    its last answer, ending with <|return|>; <|endoftext|> separates conversations. Parquet, where a message
    without reasoning has `thinking` None (a column gives every message every field), prepares the same
    bytes as JSONL, where it has no `thinking`."""
    records = conversations(12, seed=1)
    for record in records[::2]:
        record["messages"][-1]["thinking"] = "think about " + record["messages"][-1]["content"]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    table = pa.table({"messages": [record["messages"] for record in records]})
    assert table.column("messages").to_pylist()[1][0]["thinking"] is None
    pq.write_table(table, tmp_path / "chats.parquet")
    prepare.prepare([str(tmp_path / "chats.parquet")], harmony, str(tmp_path / "parquet"), val=2, chat=True,
                    field="messages")
    meta = prepare.prepare([path], harmony, str(tmp_path / "data"), val=2, chat=True, field="messages")
    backend = Tokenizer.from_folder(harmony).backend
    assert meta["loss_mask"] and meta["eos_id"] == backend.token_to_id("<|endoftext|>")
    template = ChatTemplate.from_folder(harmony, Tokenizer.from_folder(harmony))
    expected = {tuple(template.encode(record["messages"])[0]): template.encode(record["messages"])[1]
                for record in records}
    documents = 0
    for split in ("train", "val"):
        tokens = np.fromfile(tmp_path / "data" / f"{split}.bin", dtype=np.uint16)
        mask = np.fromfile(tmp_path / "data" / f"{split}.mask", dtype=np.uint8)
        ends = np.flatnonzero(tokens == meta["eos_id"])
        for start, end in zip([0, *(ends[:-1] + 1)], ends):
            ids, counted = tokens[start:end].tolist(), mask[start:end].astype(bool)
            assert counted.tolist() == list(expected[tuple(ids)]) and mask[end] == 0
            first, last = np.flatnonzero(counted)[[0, -1]]
            assert counted[first:last + 1].all() and last == len(ids) - 1  # one run, to the conversation's end
            assert ids[last] == backend.token_to_id("<|return|>")
            documents += 1
    assert documents == len(records)
    for name in ("train.bin", "val.bin", "train.mask", "val.mask"):
        assert (tmp_path / "parquet" / name).read_bytes() == (tmp_path / "data" / name).read_bytes(), name


def steer(model, prompt, step, token, new=12):
    """model's greedy continuation of prompt, made to write `token` at `step` (where it wrote another,
    written there first): the two tokens' rows of the output layer swapped, nothing before `step` changed."""
    free = model.generate(torch.tensor([prompt]), new, temperature=0)[0, len(prompt):].tolist()
    assert free[step] not in free[:step] and token not in free[:step + 1]
    with torch.no_grad():
        rows = model.lm_head.weight
        rows[[free[step], token]] = rows[[token, free[step]]]
    steered = model.generate(torch.tensor([prompt]), new, temperature=0)[0, len(prompt):].tolist()
    assert steered[:step + 1] == [*free[:step], token]
    return steered


def brief_prompt(folder):
    """(tokenizer, sample.ChatPrompt, prompt ids, messages) of sample --chat's prompt "hi there" under the system
    message "be brief", in the folder's template; the ids checked to be the template's own."""
    tokenizer = Tokenizer.from_folder(folder)
    prompter = sample.ChatPrompt(tokenizer, system="be brief")
    prompt, template = prompter.ids("hi there"), prompter.template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert prompt == template.prompt_ids(messages)
    return tokenizer, prompter, prompt, messages


def test_sample_chat_with_the_harmony_template_stops_at_return_not_at_end(harmony):
    """python -m tools.sample --chat with gpt-oss's template: the prompt ends with <|start|>assistant, and the
    reply runs on past <|end|> (which ends the analysis message, not the turn) and stops at <|return|>,
    left out. The model is a tiny GPT steered to write <|end|> and later <|return|>; what sample's pieces
    give is the greedy decoding written out in tests/texts.py."""
    from texts import greedy
    tokenizer, prompter, prompt, messages = brief_prompt(harmony)
    backend, template = tokenizer.backend, prompter.template
    assert template.render(messages, add_generation_prompt=True) == harmony_system(template) + (
        "<|start|>developer<|message|># Instructions\n\nbe brief\n\n<|end|>"
        "<|start|>user<|message|>hi there<|end|><|start|>assistant")
    end, done = backend.token_to_id("<|end|>"), backend.token_to_id("<|return|>")
    assert prompter.stop_id == done
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=len(prompt) + 16, n_layer=2, n_head=2, d_model=16)
    model = GPT(config).eval()
    steer(model, prompt, 2, end)
    steered = steer(model, prompt, 6, done)
    reply = sample.continuations(model, prompt, prompter.stop_id, max_new_tokens=12, temperature=0)[0]
    assert reply == steered[:6] and reply[2] == end
    assert reply == greedy(config, model.state_dict(), prompt, 12, prompter.stop_id)


# Gemma 3: turns between <start_of_turn> and <end_of_turn>, rendered by google/gemma-3-1b-it's template
GEMMA = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # Gemma's ids 0-3 first
GEMMA3_TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "gemma3.jinja")


def gemma_folder(path):
    """A model folder's tokenizer files as gemma-3-1b-it's are: SentencePiece's kind of BPE ("▁" for a space,
    <0xNN> tokens for the bytes the vocabulary lacks, no space put first), <pad> 0, <eos> 1, <bos> 2, <unk> 3,
    <start_of_turn> and <end_of_turn>; generation ending at <eos> or <end_of_turn> (generation_config.json's
    [1, 106]), <eos> the EOS tokenizer_config.json names, and its chat_template the template."""
    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.train_from_iterator(training_text(), trainers.BpeTrainer(vocab_size=300, special_tokens=GEMMA,
                                                                     show_progress=False))
    spec = json.loads(backend.to_str())
    for byte in range(256):  # the trainer makes no byte tokens: SentencePiece's are in the vocabulary
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    backend = Backend.from_str(json.dumps(spec))
    bos, eos, end, pad = (backend.token_to_id(name) for name in ("<bos>", "<eos>", "<end_of_turn>", "<pad>"))
    with open(GEMMA3_TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    return str(model_folder(path, backend,
                            generation_config=dict(bos_token_id=bos, eos_token_id=[eos, end], pad_token_id=pad),
                            tokenizer_config=dict(add_bos_token=True, bos_token="<bos>", eos_token="<eos>",
                                                  pad_token="<pad>", unk_token="<unk>", chat_template=template)))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return gemma_folder(tmp_path_factory.mktemp("gemma") / "gemma-3-1b-it")


def test_gemma3_counts_each_model_turn_through_its_end_of_turn(gemma):
    """Gemma's template writes <bos>, the system message folded into the first user turn, and each turn as
    <start_of_turn>{user or model}\\n{content, trimmed}<end_of_turn>\\n. The loss counts what the model writes
    after the generation prompt <start_of_turn>model\\n: each answer and its <end_of_turn>, not the newline
    the template puts after it (the model stops at <end_of_turn>: that newline is the next turn's input)."""
    tokenizer = Tokenizer.from_folder(gemma)
    template = ChatTemplate.from_folder(gemma, tokenizer)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": " good bye\n"}]  # the template trims what it writes
    pieces = [("<bos><start_of_turn>user\nYou are terse.\n\nhi there<end_of_turn>\n<start_of_turn>model\n", False),
              ("hello<end_of_turn>", True),
              ("\n<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n", False),
              ("good bye<end_of_turn>", True),
              ("\n", False)]
    assert template.render(messages) == "".join(piece for piece, _ in pieces)
    assert counted_runs(template, messages) == pieces
    ids, counted = template.encode(messages)
    backend = tokenizer.backend
    special = {backend.token_to_id(name): name for name in GEMMA}
    assert [special[i] for i in ids if i in special] == ["<bos>", *["<start_of_turn>", "<end_of_turn>"] * 4]
    assert [special[i] for i, c in zip(ids, counted) if c and i in special] == ["<end_of_turn>"] * 2
    answer = lambda text: tokenizer.encode_rendered(text)[0]  # noqa: E731
    assert [i for i, c in zip(ids, counted) if c] == answer("hello<end_of_turn>") + answer("good bye<end_of_turn>")
    # the prompt a reply is sampled from ends with the generation prompt; the reply ends at <end_of_turn>
    assert template.render(messages[:4], add_generation_prompt=True) == "".join(piece for piece, _ in pieces[:3])
    assert template.end_of_turn == "<end_of_turn>"
    assert template.end_of_turn_id() == backend.token_to_id("<end_of_turn>")
    # the EOS is <eos>, the first id that ends a generation; conversations are separated by it, which the
    # template never writes (it ends turns with <end_of_turn>, which would cut each conversation at every turn)
    ends = chat_lib.end_ids(gemma, tokenizer)
    assert tokenizer.eos_id == backend.token_to_id("<eos>")
    assert ends == [backend.token_to_id(name) for name in ("<eos>", "<end_of_turn>", "<pad>")]
    assert template.document_end(ends) == backend.token_to_id("<eos>")
    with pytest.raises(ChatError, match="cannot render the conversation: Conversation roles must alternate"):
        template.encode([messages[1], messages[2], messages[2]])


def test_prepare_chat_with_the_gemma3_template(gemma, tmp_path):
    """python -m tools.prepare --chat with Gemma's template: <eos> ends each conversation in the token files and
    appears nowhere else; each conversation's counted tokens are its model turns, each the answer and its
    <end_of_turn> (the template's newline after it, the user's turns, the system message: none)."""
    records = conversations(12, seed=2)
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    meta = prepare.prepare([path], gemma, str(tmp_path / "data"), val=2, chat=True, field="messages")
    tokenizer = Tokenizer.from_folder(gemma)
    backend = tokenizer.backend
    eos, end = backend.token_to_id("<eos>"), backend.token_to_id("<end_of_turn>")
    assert meta["loss_mask"] and meta["eos_id"] == eos
    template = ChatTemplate.from_folder(gemma, tokenizer)
    answers = {}  # a conversation's ids: the ids of its model turns, each the answer and <end_of_turn>
    for record in records:
        ids = template.encode(record["messages"])[0]
        assert eos not in ids and "<eos>" not in template.render(record["messages"])
        answers[tuple(ids)] = [tokenizer.encode_rendered(message["content"] + "<end_of_turn>")[0]
                               for message in record["messages"] if message["role"] == "assistant"]
    documents = 0
    for split in ("train", "val"):
        tokens = np.fromfile(tmp_path / "data" / f"{split}.bin", dtype=np.uint16)
        mask = np.fromfile(tmp_path / "data" / f"{split}.mask", dtype=np.uint8)
        assert len(tokens) == len(mask) and tokens[-1] == eos
        ends = np.flatnonzero(tokens == eos)
        for start, stop in zip([0, *(ends[:-1] + 1)], ends):
            ids, counted = tokens[start:stop].tolist(), mask[start:stop].astype(bool)
            assert mask[stop] == 0
            runs = []  # the counted runs of ids
            for i, c in enumerate(counted):
                if c and (i == 0 or not counted[i - 1]):
                    runs.append([])
                if c:
                    runs[-1].append(ids[i])
            assert runs == answers[tuple(ids)]
            assert all(run[-1] == end for run in runs) and counted.sum() == sum(map(len, runs))
            documents += 1
    assert documents == len(records)


def test_sample_chat_with_the_gemma3_template_stops_at_end_of_turn(gemma):
    """python -m tools.sample --chat with Gemma's template: the prompt ends with <start_of_turn>model\\n, and the
    reply stops at <end_of_turn> (left out), not at the tokenizer's EOS <eos>. The model is a tiny GPT steered
    to write <end_of_turn>; what sample's pieces give is the greedy decoding written out in tests/texts.py."""
    from texts import greedy
    tokenizer, prompter, prompt, messages = brief_prompt(gemma)
    backend, template = tokenizer.backend, prompter.template
    assert template.render(messages, add_generation_prompt=True) == \
        "<bos><start_of_turn>user\nbe brief\n\nhi there<end_of_turn>\n<start_of_turn>model\n"
    end = backend.token_to_id("<end_of_turn>")
    assert prompter.stop_id == end != tokenizer.eos_id
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=len(prompt) + 16, n_layer=2, n_head=2, d_model=16)
    model = GPT(config).eval()
    steered = steer(model, prompt, 5, end)
    reply = sample.continuations(model, prompt, prompter.stop_id, max_new_tokens=12, temperature=0)[0]
    assert reply == steered[:5] and end not in reply
    assert reply == greedy(config, model.state_dict(), prompt, 12, prompter.stop_id)


def test_a_template_reaching_for_python_is_refused_without_running_anything(tmp_path):
    marker = tmp_path / "ran"
    tokenizer = Tokenizer.from_folder(chat_folder(tmp_path / "plain"))
    for template in ["{{ ''.__class__.__mro__ }}",
                     "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}",
                     "{{ messages.__class__.__base__.__subclasses__() }}"]:
        with pytest.raises(ChatError, match="is refused: the template reaches for"):
            ChatTemplate(template + QWEN3_LIKE, tokenizer)
    assert not marker.exists()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def conversations(n, seed=0):
    """n conversations of words: a system prompt in some, one to three exchanges each."""
    rng = np.random.default_rng(seed)
    say = lambda: " ".join(rng.choice(WORDS, rng.integers(2, 12)))  # noqa: E731
    found = []
    for _ in range(n):
        messages = [{"role": "system", "content": say()}] if rng.random() < 0.5 else []
        for _ in range(rng.integers(1, 4)):
            messages += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
        found.append({"messages": messages})
    return found


@pytest.mark.parametrize("record,message", [
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, r"chats.jsonl:2: message 1 has no role"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"chats.jsonl:2: the conversation has no assistant turn"),
    ({"messages": [{"role": "tool", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     r"chats.jsonl:2: .* cannot render the conversation: unknown role tool"),
    ({"messages": [{"role": "user", "content": "<|endoftext|>"}, {"role": "assistant", "content": "x"}]},
     r"chats.jsonl:2: the conversation writes '<\|endoftext\|>'"),
    ({"messages": "hello"}, r"chats.jsonl:2: the conversation is a str"),
], ids=["no-role", "no-assistant", "unrenderable", "writes-the-separator", "not-a-list"])
def test_bad_conversations_are_named_by_file_and_line(folder, tmp_path, record, message):
    path = write_jsonl(tmp_path / "chats.jsonl", [conversations(1)[0], record])
    with pytest.raises(prepare.PrepareError, match=message) as raised:
        prepare.prepare([path], folder, str(tmp_path / "out"), val=1, chat=True, field="messages")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out" / "train.bin").exists()


def test_a_folder_without_a_template_is_named(tmp_path):
    folder = chat_folder(tmp_path / "model", template=None)
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(3))
    with pytest.raises(prepare.PrepareError, match="no chat template"):
        prepare.prepare([path], folder, str(tmp_path / "out"), val=1, chat=True, field="messages")


@pytest.fixture(scope="module")
def chats(folder, tmp_path_factory):
    """A chat dataset prepared from .jsonl, with its masks."""
    root = tmp_path_factory.mktemp("chats")
    path = write_jsonl(root / "chats.jsonl", conversations(120))
    prepare.prepare([path], folder, str(root / "data"), val=10, chat=True, field="messages", workers=2)
    return str(root / "data")


def test_prepared_conversations_and_their_masks(folder, chats, tmp_path):
    """Each conversation is its ids and the separator, its mask the assistant's tokens; Parquet (a list of
    {role, content} a row) prepares the same bytes as JSONL."""
    meta = json.loads(open(f"{chats}/meta.json").read())
    tokenizer = Tokenizer.from_folder(folder)
    assert meta["loss_mask"] and meta["eos_id"] == tokenizer.backend.token_to_id("<|endoftext|>")
    template = ChatTemplate.from_folder(folder, tokenizer)
    tokens, mask = (np.fromfile(f"{chats}/train.{s}", dtype=d) for s, d in (("bin", np.uint16), ("mask", np.uint8)))
    ends = np.flatnonzero(tokens == meta["eos_id"])
    assert len(ends) == meta["documents"]["train"] == 110 and ends[-1] == len(tokens) - 1
    first = tokens[:ends[0]].tolist()
    for record in conversations(120):  # the first conversation of the train split
        ids, counted = template.encode(record["messages"])
        if ids == first:
            assert mask[:ends[0] + 1].tolist() == [*map(int, counted), 0]
            break
    else:
        raise AssertionError("the train split's first conversation is none of the inputs")
    table = pa.table({"messages": [record["messages"] for record in conversations(120)]})
    pq.write_table(table, tmp_path / "chats.parquet", row_group_size=25)
    prepare.prepare([str(tmp_path / "chats.parquet")], folder, str(tmp_path / "data"), val=10, chat=True,
                    field="messages")
    for name in ("train.bin", "val.bin", "train.mask", "val.mask"):
        assert (tmp_path / "data" / name).read_bytes() == open(f"{chats}/{name}", "rb").read(), name


CHAT = [*EQUIVALENCE, "--seq-len", "32"]


def test_only_the_assistants_tokens_count_in_the_loss(chats):
    """One device's first loss is the mean cross-entropy over the targets the mask counts (and that are not
    predicted at a separator), computed here from the logits."""
    argv = [*CHAT, "--data", chats]
    args = cli.parse_args(argv)
    data = train.load_training_data(args)
    model = train.build_model(cli.model_config(args, data.vocab_size), args.seed, torch.float64, torch.device("cpu"))
    tokens = data.batch("train", 0, args.batch_size, args.seq_len)
    counted = data.loss_mask("train", 0, args.batch_size, args.seq_len)[:, 1:] & (tokens[:, :-1] != data.info.eos_id)
    assert 0.2 < counted.float().mean() < 0.8  # a mask that leaves some out, and keeps some
    logits = model(tokens[:, :-1], documents=document_ids(tokens[:, :-1], data.info.eos_id))[0]
    losses = torch.nn.functional.cross_entropy(logits[..., :data.vocab_size].flatten(0, 1), tokens[:, 1:].flatten(),
                                               reduction="none").view_as(counted)
    expected = losses[counted].mean().item()
    assert oracle(argv)["losses"][0] == pytest.approx(expected, rel=1e-12)
    assert abs(losses.mean().item() - expected) > 1e-3  # every target counted would be another loss


@pytest.mark.parametrize("world,flags", [(2, ["--tp", "2", "--sp"]), (2, ["--pp", "2", "--zero", "1"]),
                                         (2, ["--cp", "2"])], ids=["tp2-sp", "pp2-zero1", "cp2"])
def test_a_chat_run_trains_as_one_device(chats, tmp_path, world, flags):
    argv = [*CHAT, "--data", chats]
    for result in run_on_ranks(world, train_worker, [*argv, *flags, "--out", str(tmp_path)], timeout=180):
        assert_matches_oracle(result, oracle(argv))


def test_sample_chat_answers_with_the_template_and_stops_at_the_end_of_the_turn(folder, chats, tmp_path, capsys):
    """python -m tools.sample --chat: the prompt as a user's turn after --system's, rendered with the generation
    prompt; what it prints is model.py's greedy decoding of those ids (written out in tests/texts.py), up to
    the end-of-turn token."""
    from texts import greedy
    run = [*CHAT, "--steps", "2", "--data", chats, "--out", str(tmp_path)]
    result = run_on_ranks(1, train_worker, run, timeout=180)[0]
    args = cli.parse_args(run)
    config = cli.model_config(args, train.load_training_data(args).vocab_size)
    template = ChatTemplate.from_folder(folder, Tokenizer.from_folder(folder))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    end_of_turn = template.end_of_turn_id()
    assert end_of_turn == template.tokenizer.backend.token_to_id("<|im_end|>")
    expected = greedy(config, result["state_dict"], template.prompt_ids(messages), 12, end_of_turn)
    assert expected, "a reply of no tokens would not show the prompt was rendered"
    sample.main(["--checkpoint", str(tmp_path / os.listdir(tmp_path)[0]), "--chat", "--system", "be brief",
                 "--prompt", "hi there", "--temperature", "0", "--max-new-tokens", "12"])
    assert capsys.readouterr().out == template.tokenizer.decode(expected) + "\n"
    with pytest.raises(SystemExit):
        sample.main(["--checkpoint", str(tmp_path), "--system", "be brief", "--prompt", "hi"])
    assert "--system is a chat's system message: it needs --chat" in capsys.readouterr().err


def test_a_chat_template_jinja_file_is_read_first_and_exported_with_the_model(folder, tmp_path):
    """transformers 4.50 on saves the template as chat_template.jinja: it wins over tokenizer_config.json's, and
    tools/convert.py's export carries it along with the tokenizer."""
    from tools import convert
    own = tmp_path / "own"
    convert.copy_tokenizer(folder, tmp_path)  # the folder's tokenizer files, as an export copies them
    (tmp_path / "chat_template.jinja").write_text(QWEN3_LIKE.replace("<|im_start|>assistant\\n'", "<|im_start|>bot\\n'"))
    convert.copy_tokenizer(str(tmp_path), str(own.mkdir() or own))
    assert (own / "chat_template.jinja").read_text() == (tmp_path / "chat_template.jinja").read_text()
    template = ChatTemplate.from_folder(str(own), Tokenizer.from_folder(str(own)))
    assert template.render(CONVERSATION[:2], add_generation_prompt=True).endswith("<|im_start|>bot\n")
