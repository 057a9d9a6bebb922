"""The requests `bench serve` sends: `random`, `sharegpt` and `prefix-chat`, as vLLM's bench names them,
and `ids`, an exact list of token-id prompts replayed from a file.

A request is a list of messages (role, content) plus the number of tokens to ask for. Content
is either token ids (random, prefix-chat) or text (sharegpt). `BenchRequest.body` renders it
for the endpoint and the prompt format the server takes:

- `ids`: a completions prompt as one list of token ids (pagedkv and vLLM accept it), exact lengths;
- `text`: a completions prompt as one string;
- `chat`: chat messages.

Token ids become text one word per id (`WORDS`), common English words that BPE vocabularies
hold as single tokens, so a text prompt is about as long in tokens as its ids version. The
server's `usage` gives the exact counts the metrics use.

```
prefix-chat, conversation c, turn t (c uses system prompt c % num_prefixes):
| system prompt (shared) | user 0 | assistant 0 | ... | user t-1 | assistant t-1 | user t |
```
Assistant turns are synthetic, so every turn is a request of its own that needs no earlier
answer, and turn t+1 extends turn t: both the system prompt and the conversation so far can
come from a prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
import random
from importlib import resources
from pathlib import Path

from pagedkv.errors import InvalidArgumentError

PROMPT_FORMATS = ("ids", "text", "chat")

#: The synthetic ShareGPT file that ships with the package (for tests and --smoke).
SHAREGPT_SAMPLE = "sharegpt_sample.json"

#: Random token ids start here, above the special tokens every vocabulary puts first.
FIRST_RANDOM_ID = 100

WORDS = tuple("""the of and to in is it you that he was for on are with as his they be at one have this from
or had by word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever red list though feel talk
bird soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole
king space heard best hour better true during hundred five remember step early hold west ground interest
reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest able
pound done beauty drive stood contain front teach week final gave green quick develop ocean warm free
minute strong special mind behind clear tail produce fact street inch multiply nothing course stay wheel
full force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring
yes distant fill east paint language among""".split())

Content = tuple[int, ...] | str


def ids_to_text(token_ids: tuple[int, ...]) -> str:
    """One word per token id: a text prompt about as many tokens long as `token_ids`."""
    return " ".join(WORDS[token_id % len(WORDS)] for token_id in token_ids)


def estimate_num_tokens(text: str) -> int:
    """Tokens in `text` by OpenAI's rule of thumb (4 characters a token); the server's `usage` is exact."""
    return max(1, round(len(text) / 4))


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request: its messages (role, token ids or text), prompt length in tokens, and max_tokens to ask for."""

    messages: tuple[tuple[str, Content], ...]
    num_prompt_tokens: int  # exact for token ids, estimated for text
    max_tokens: int
    prefix_id: int | None = None  # prefix-chat: which shared system prompt

    def __post_init__(self):
        if self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def is_token_ids(self) -> bool:
        return all(not isinstance(content, str) for _, content in self.messages)

    def body(self, prompt_format: str) -> dict:
        """The request's `prompt` (completions) or `messages` (chat) field, rendered in `prompt_format`."""
        if prompt_format == "chat":
            return {"messages": [{"role": role, "content": _as_text(content)} for role, content in self.messages]}
        if prompt_format == "ids" and self.is_token_ids:
            return {"prompt": [token_id for _, content in self.messages for token_id in content]}
        if prompt_format in ("ids", "text"):
            return {"prompt": "\n\n".join(_as_text(content) for _, content in self.messages)}
        raise InvalidArgumentError(f"prompt format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")


def _as_text(content: Content) -> str:
    return content if isinstance(content, str) else ids_to_text(content)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """[low, high] of lengths uniform around `length` (vLLM's --random-range-ratio), never below 1."""
    if length < 1:
        raise InvalidArgumentError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise InvalidArgumentError(f"range ratio must be in [0, 1), got {range_ratio}")
    return max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))


def _random_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_RANDOM_ID, vocab_size) for _ in range(num_tokens))


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """`random`: prompts of random token ids, input and output lengths uniform in their ranges."""
    if vocab_size <= FIRST_RANDOM_ID:
        raise InvalidArgumentError(f"vocab size must be > {FIRST_RANDOM_ID}, got {vocab_size}")
    rng = random.Random(seed)
    input_range, output_range = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_requests):
        num_prompt_tokens = rng.randint(*input_range)
        requests.append(BenchRequest((("user", _random_ids(rng, num_prompt_tokens, vocab_size)),),
                                     num_prompt_tokens, rng.randint(*output_range)))
    return requests


def sharegpt_path() -> Path:
    """The small synthetic ShareGPT-format file shipped with pagedkv."""
    return Path(str(resources.files("pagedkv.bench.serve") / "data" / SHAREGPT_SAMPLE))


def sharegpt_requests(path: str | Path, num_requests: int, seed: int, output_len: int | None = None,
                      max_prompt_tokens: int = 1024, max_total_tokens: int = 2048) -> list[BenchRequest]:
    """`sharegpt`: the first human turn of each conversation as the prompt, its reply's length as max_tokens.

    As in vLLM, conversations shorter than two turns are skipped, as are pairs with fewer than 4
    tokens on either side or longer than `max_prompt_tokens` / `max_total_tokens`; the rest are
    shuffled with `seed` and cycled when fewer than `num_requests` remain. `output_len`
    overrides every reply length.
    """
    try:
        conversations = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise InvalidArgumentError(f"cannot read ShareGPT file {str(path)!r}: {error}") from None
    if not isinstance(conversations, list):
        raise InvalidArgumentError(f"ShareGPT file {str(path)!r} must hold a JSON list of conversations")
    pairs = []
    for conversation in conversations:
        turns = conversation.get("conversations", []) if isinstance(conversation, dict) else []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        num_prompt_tokens, num_reply_tokens = estimate_num_tokens(prompt), estimate_num_tokens(reply)
        if output_len is not None:
            num_reply_tokens = output_len
        if (num_prompt_tokens < 4 or num_reply_tokens < 4 or num_prompt_tokens > max_prompt_tokens
                or num_prompt_tokens + num_reply_tokens > max_total_tokens):
            continue
        pairs.append(BenchRequest((("user", prompt),), num_prompt_tokens, num_reply_tokens))
    if not pairs:
        raise InvalidArgumentError(f"ShareGPT file {str(path)!r} has no usable conversation (two turns, "
                                   f"4..{max_prompt_tokens} prompt tokens, <= {max_total_tokens} in all)")
    random.Random(seed).shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(num_requests)]


def token_id_requests(path: str | Path, num_requests: int) -> list[BenchRequest]:
    """`ids`: the first `num_requests` of a JSON list of {"prompt_token_ids": [...], "max_tokens": N}, in order.

    Replays an exact request list (an offline engine run's, say) so the server sees the same
    prompts and lengths. Never cycles: a repeated prompt would hit the prefix cache.
    """
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise InvalidArgumentError(f"cannot read token-id file {str(path)!r}: {error}") from None
    if not isinstance(rows, list):
        raise InvalidArgumentError(f"token-id file {str(path)!r} must hold a JSON list of requests")
    if num_requests > len(rows):
        raise InvalidArgumentError(f"token-id file {str(path)!r} holds {len(rows)} requests, {num_requests} "
                                   f"asked for: pass --num-prompts {len(rows)} or fewer")
    requests = []
    for index, row in enumerate(rows[:num_requests]):
        ids = row.get("prompt_token_ids") if isinstance(row, dict) else None
        max_tokens = row.get("max_tokens") if isinstance(row, dict) else None
        if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids)
                or not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
            raise InvalidArgumentError(f"token-id file {str(path)!r}, request {index}: expected "
                                       f'{{"prompt_token_ids": [non-negative ints], "max_tokens": int}}, got '
                                       f"{str(row)[:120]}")
        requests.append(BenchRequest((("user", tuple(ids)),), len(ids), max_tokens))
    return requests


def prefix_chat_requests(num_prefixes: int, num_conversations: int, num_turns: int, prefix_len: int,
                         input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                         seed: int) -> list[BenchRequest]:
    """`prefix-chat`: `num_prefixes` system prompts shared by `num_conversations` conversations of `num_turns`.

    Returns num_conversations × num_turns requests, turn by turn (every conversation's turn 0,
    then every turn 1, ...), so a turn usually arrives after the one it extends.
    """
    for name, value in (("num_prefixes", num_prefixes), ("num_conversations", num_conversations),
                        ("num_turns", num_turns), ("prefix_len", prefix_len)):
        if value < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    if vocab_size <= FIRST_RANDOM_ID:
        raise InvalidArgumentError(f"vocab size must be > {FIRST_RANDOM_ID}, got {vocab_size}")
    rng = random.Random(seed)
    input_range, output_range = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    histories: list[list[tuple[str, Content]]] = [[("system", prefixes[c % num_prefixes])]
                                                  for c in range(num_conversations)]
    requests = []
    for _ in range(num_turns):
        for c, history in enumerate(histories):
            history.append(("user", _random_ids(rng, rng.randint(*input_range), vocab_size)))
            max_tokens = rng.randint(*output_range)
            num_prompt_tokens = sum(len(content) for _, content in history)
            requests.append(BenchRequest(tuple(history), num_prompt_tokens, max_tokens, prefix_id=c % num_prefixes))
            history.append(("assistant", _random_ids(rng, max_tokens, vocab_size)))
    return requests
