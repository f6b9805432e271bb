"""Random checkpoints shaped like Qwen2.5, Qwen3 and Llama 3.2, with chat templates written here that
show the tools and write calls and tool results as those families' templates do (hermes
`<tool_call>` blocks with `<tool_response>` results; Qwen3's think blocks, opened by the prompt
unless `enable_thinking` is false; Llama 3.2's JSON calls with `ipython` results), and tokenizers
that hold each family's tags as single added tokens. The tool tests share them."""

import json

from tests.helpers import make_llama_checkpoint

_HERMES_SYSTEM = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}")
_HERMES_TURNS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}{% if loop.first and m.content %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n"
    "</tool_call>{% if not loop.last %}\n{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}{% endif %}"
    "{%- endfor %}")
QWEN25 = _HERMES_SYSTEM + _HERMES_TURNS + "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# Qwen3's thinking templates (2507-Thinking, 3.5) open the think block in the prompt; enable_thinking
# false closes an empty one there instead, as Qwen3's template does.
QWEN3 = (_HERMES_SYSTEM + _HERMES_TURNS + "{%- if add_generation_prompt %}<|im_start|>assistant\n"
         "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
         "{% else %}<think>\n{% endif %}{% endif %}")
LLAMA32 = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}Cutting Knowledge Date: December 2023\n\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}\n\nGiven the following functions, respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt, in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}"
    "<|eot_id|>"
    "{%- for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m.tool_calls %}{\"name\": \"{{ tc.function.name }}\", \"parameters\": "
    "{{ tc.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

FAMILIES = {  # name -> (model_type, template, the tags its tokenizer holds whole, end-of-turn token)
    "qwen2.5": ("qwen2", QWEN25, ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                                  "</tool_response>"], "<|im_end|>"),
    "qwen3": ("qwen3", QWEN3, ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                                "</tool_response>", "<think>", "</think>"], "<|im_end|>"),
    "llama3.2": ("llama", LLAMA32, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                    "<|python_tag|>"], "<|eot_id|>"),
}


def tool_checkpoint(family: str, path, seed: int = 0):
    """A random checkpoint of `family` (FAMILIES) at `path`: its tags added to the tokenizer as
    single tokens (`<|...|>` ones special, the text dropping them; the others, such as <tool_call>
    and <think>, kept in the text, as Qwen's tokenizers do), its chat template set, and its
    end-of-turn token an end-of-sequence id beside <|endoftext|>."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    model_type, template, tags, eot = FAMILIES[family]
    make_llama_checkpoint(path, model_type=model_type, seed=seed, max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [t for t in tags if t.startswith("<|")]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags if not t.startswith("<|")])
    tok.chat_template = template
    tok.save_pretrained(path)
    gen = {"eos_token_id": [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids(eot)]}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
