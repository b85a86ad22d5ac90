"""Chat templates in the shape of each model family's own, for test models that must look like that family to the
router (tests/conftest.py writes one into a copy of the tiny model). Each keeps what the router reads or relies
on: the markers that name its tool-call format, how it renders tools, calls and results, and, for the reasoning
models, how the generation prompt leaves the `<think>` block. Shortened from the originals; tokens such as
`<|im_start|>` are plain text to the tiny model's tokenizer, which changes nothing the router does."""

from __future__ import annotations

# Qwen3's: tools in the system turn, calls as <tool_call> blocks (Hermes), past reasoning from
# `reasoning_content`, and `enable_thinking: false` closing an empty <think> block in the generation prompt.
# (transformers renders with trim_blocks, so text that must keep its newlines is written as expressions, as the
# originals do.)
QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    "{%- if message.reasoning_content is string %}"
    "{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'\n<tool_call>\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

# DeepSeek-R1's (and Qwen3's thinking-only checkpoints'): the generation prompt opens the <think> block itself.
R1 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{- message.content }}"
    "{%- elif message.role == 'user' %}{{- '<|User|>' + message.content }}"
    "{%- elif message.role == 'assistant' %}{{- '<|Assistant|>' + (message.content or '') + '<|end of sentence|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|Assistant|><think>\n' }}{%- endif %}"
)

# Llama 3.1's: tools in the first user turn with the instruction to answer in JSON, "parameters" for arguments,
# results as `ipython` turns.
LLAMA3 = (
    "{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}"
    "{%- for message in messages if message.role == 'system' %}{{- message.content }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- for message in messages if message.role != 'system' %}"
    "{%- if message.role == 'user' %}{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}"
    "{%- if tools and loop.first %}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\n\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- for call in message.tool_calls %}"
    '{{- \'{"name": "\' + call.function.name + \'", "parameters": \' }}{{- call.function.arguments | tojson }}'
    "{{- '}' }}{%- if not loop.last %}{{- '; ' }}{%- endif %}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# Mistral's (v3 tokenizer): tools before the last user turn, calls after [TOOL_CALLS] as a JSON list with their
# ids, which must be 9 letters and digits (the template refuses others, as Mistral's does).
MISTRAL = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{- message.content + '\n\n' }}"
    "{%- elif message.role == 'user' %}"
    "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS][' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not string or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    '{{- \'{"name": "\' + call.function.name + \'", "arguments": \' }}{{- call.function.arguments | tojson }}'
    "{{- ', \"id\": \"' + call.id + '\"}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}{{- message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    '{{- \'[TOOL_RESULTS]{"content": \' + (message.content | tojson) + \', "call_id": "\' + message.tool_call_id }}'
    "{{- '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)

# Phi-4-mini's: the tools between <|tool|> and <|/tool|> in the system turn (Phi-4-mini's own template reads them
# from the system message's `tools` field; this one from the `tools` the API passes), calls between <|tool_call|>
# and <|/tool_call|>.
PHI4_MINI = (
    "{%- if tools %}{{- '<|system|>' }}"
    "{%- for message in messages if message.role == 'system' %}{{- message.content }}"
    "{%- else %}{{- 'You are a helpful assistant with some tools.' }}{%- endfor %}"
    "{{- '<|tool|>' + (tools | tojson) + '<|/tool|><|end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|assistant|><|tool_call|>[' }}"
    "{%- for call in message.tool_calls %}"
    '{{- \'{"name": "\' + call.function.name + \'", "arguments": \' }}{{- call.function.arguments | tojson }}'
    "{{- '}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']<|/tool_call|><|end|>' }}"
    "{%- else %}{{- '<|' + message.role + '|>' + message.content + '<|end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- else %}{{- eos_token }}{%- endif %}"
)

CHAT_TEMPLATES = {"qwen3": QWEN3, "r1": R1, "llama3": LLAMA3, "mistral": MISTRAL, "phi4_mini": PHI4_MINI}
