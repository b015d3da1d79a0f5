"""Conversations as a model's own chat template renders them, and which of their tokens the loss counts.

    chat = ChatTemplate.from_folder("Qwen3-0.6B")
    ids, counted = chat.encode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    prompt = chat.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

The template is the folder's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a
string, or a list of named templates: the one named "default"). It is rendered as transformers renders it:
Jinja2 with trim_blocks and lstrip_blocks, the variables `messages`, `add_generation_prompt` and the
special tokens' names (`bos_token`, `eos_token`, ...), `raise_exception`, `tojson` and `strftime_now`
(gpt-oss's template writes the current date with it: here the date the template was loaded, so that every
render of a conversation agrees), and `{% generation %}` blocks rendered as their content.

A template is code from whoever wrote the folder, so it runs in Jinja2's immutable sandbox, as
transformers runs it: it reads the values it is given and calls nothing of Python's. An attribute the
sandbox deems unsafe (`{{ ''.__class__ }}`) is refused at once, with an error, rather than rendered as
an empty string as the sandbox itself would.

Which tokens count: an assistant turn is what the template writes after the generation prompt (the
prefix a model is given to answer from) up to and including the template's end-of-turn marker
(`<|im_end|>`, `<|eot_id|>`, ...; found once by rendering a probe conversation). Each turn is located in
the whole conversation's text: its start is the length of the conversation before it, rendered with
the generation prompt, which must be a prefix of the whole (a template that renders earlier turns
differently once later ones follow, as Qwen3's drops an earlier answer's reasoning, still is); its end
is the first end-of-turn marker after it, before the next assistant turn starts. A turn with no marker
there is the model's input, not what it writes, and does not count: gpt-oss's harmony template ends the
last answer with <|return|> (its end of generation) after its reasoning (the analysis channel), and
earlier ones with <|end|>, their reasoning dropped, as the model reads its past answers; training on
those would teach it to answer unreasoned and end with a token generation does not stop at. A token
counts when its first character lies in a turn.
"""
import json
import os
from datetime import datetime

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from training.tokenizer import read_json

PROBE = [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "probe answer"}]


class ChatError(ValueError):
    """A template that cannot be found or rendered, or a conversation it cannot be applied to."""


class RefusingSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, where an unsafe attribute is an error, not an empty value."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"the template reaches for {type(obj).__name__}.{attribute}, which the sandbox "
                            f"does not give (a chat template reads values; it runs no Python)")


class GenerationBlocks(Extension):
    """`{% generation %} ... {% endgeneration %}` (transformers marks assistant text with it): its content."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def raise_exception(message):
    raise TemplateError(message)


def tojson(value, indent=None):
    return json.dumps(value, ensure_ascii=False, indent=indent)


def template_source(folder):
    """The chat template's text: chat_template.jinja, else tokenizer_config.json's chat_template."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = read_json(folder, "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str):
        raise ChatError(f"{folder}: no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                        f"chat_template)")
    return template


def special_token_names(folder):
    """{bos_token: "<s>", ...}: the special tokens' names the template may write, from tokenizer_config.json."""
    config = read_json(folder, "tokenizer_config.json")
    names = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            names[key] = token
    return names


def end_ids(folder, tokenizer):
    """The ids that may end a document, in the order they are preferred: the tokenizer's EOS, the other ids
    that end a generation (generation_config.json's or config.json's eos_token_id list), the padding token."""
    ids = [tokenizer.eos_id]
    for name in ("generation_config.json", "config.json"):
        listed = read_json(folder, name).get("eos_token_id")
        ids += listed if isinstance(listed, list) else [listed]
    pad = special_token_names(folder).get("pad_token")
    ids.append(pad and tokenizer.backend.token_to_id(pad))
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))


def check_messages(messages):
    """A conversation: a list of {role: str, content: str} with at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"the conversation is a {type(messages).__name__}, not a non-empty list of messages")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(f"message {number} has no role (each message is {{\"role\": ..., \"content\": ...}})")
        if not isinstance(message.get("content"), str):
            raise ChatError(f"message {number} ({message['role']}) has no content string")
    if not any(message["role"] == "assistant" for message in messages):
        raise ChatError("the conversation has no assistant turn: no token of it would be trained")


class ChatTemplate:
    """A folder's chat template with its tokenizer: render a conversation, and encode it with its loss mask."""

    def __init__(self, source, tokenizer, special_tokens=None, where="the chat template"):
        self.tokenizer, self.where = tokenizer, where
        environment = RefusingSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks])
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        self.loaded_at = datetime.now()
        environment.globals["strftime_now"] = self.loaded_at.strftime
        try:
            self.template = environment.from_string(source)
        except TemplateError as e:
            raise ChatError(f"{where} cannot be read: {e}") from None
        self.special_tokens = special_tokens or {}
        self.end_of_turn = self.probe_end_of_turn()

    @classmethod
    def from_folder(cls, folder, tokenizer):
        return cls(template_source(folder), tokenizer, special_token_names(folder),
                   where=f"{folder}'s chat template")

    def render(self, messages, add_generation_prompt=False):
        # A field that is None is left out, as JSONL leaves out what a message lacks: a Parquet column of
        # messages gives each every field, None where it has none (`thinking` in a turn without reasoning),
        # and templates ask whether a message has a field (gpt-oss's: `"thinking" in message`).
        messages = [{key: value for key, value in message.items() if value is not None}
                    if isinstance(message, dict) else message for message in messages]
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except SecurityError as e:
            raise ChatError(f"{self.where} is refused: {e}") from None
        except Exception as e:  # raise_exception's TemplateError, or the template's own mistake
            raise ChatError(f"{self.where} cannot render the conversation: {e}") from None

    def probe_end_of_turn(self):
        """What the template writes after an assistant's text, up to the next turn (whitespace left out)."""
        text = self.render(PROBE)
        answer = PROBE[-1]["content"]
        if answer not in text:
            raise ChatError(f"{self.where} does not write an assistant's answer as it is given")
        end = text[text.rindex(answer) + len(answer):].rstrip()
        if not end:
            raise ChatError(f"{self.where} writes nothing after an assistant's answer: its turns have no end "
                            f"the model could learn to stop at")
        return end

    def assistant_spans(self, messages):
        """(the conversation's text, [(start, end)] of each assistant turn in it that ends as the model ends
        its answers, end-of-turn included)."""
        check_messages(messages)
        text = self.render(messages)
        starts = []  # where each assistant turn starts in the text
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(before):
                raise ChatError(f"{self.where} renders the conversation before message {i + 1} differently "
                                f"once it follows: the answer's place cannot be found")
            starts.append(len(before))
        spans = []
        for start, limit in zip(starts, [*starts[1:], len(text)]):
            end = text.find(self.end_of_turn, start, limit)
            if end >= 0:  # else the template writes this turn as the model's input (see the docstring)
                spans.append((start, end + len(self.end_of_turn)))
        if not spans:
            raise ChatError(f"{self.where} ends no assistant turn of the conversation with {self.end_of_turn!r}, "
                            f"as it ends the answers the model writes: no token of it would be trained")
        return text, spans

    def encode(self, messages):
        """(ids, counted): the conversation's token ids as its template writes them (special tokens' names
        are those tokens), and per token whether the loss counts it (it starts inside an assistant turn)."""
        text, spans = self.assistant_spans(messages)
        ids, offsets = self.tokenizer.encode_rendered(text)
        counted = [any(start <= first < end for start, end in spans) for first, _ in offsets]
        return ids, counted

    def prompt_ids(self, messages):
        """The ids a model answers from: the conversation so far and the generation prompt."""
        return self.tokenizer.encode_rendered(self.render(messages, add_generation_prompt=True))[0]

    def document_end(self, candidates):
        """The first of candidates (ids that may end a document) that the template never writes: the one
        that separates conversations in the token files, since document masking cuts at every one."""
        written = set(self.tokenizer.encode_rendered(self.render([{"role": "system", "content": "probe"}, *PROBE]))[0])
        for token_id in candidates:
            if token_id is not None and token_id not in written:
                return token_id
        raise ChatError(f"{self.where} writes every token that could end a conversation in the token files "
                        f"(ids {[c for c in candidates if c is not None]}: EOS, the ids that end a generation, the "
                        f"padding token), so packed conversations could not be told apart")

    def end_of_turn_id(self):
        """The id of the end-of-turn marker where it is one token (a reply stops there), else None."""
        ids, _ = self.tokenizer.encode_rendered(self.end_of_turn)
        return ids[0] if len(ids) == 1 else None
