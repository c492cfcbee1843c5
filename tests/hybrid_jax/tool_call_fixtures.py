"""Model output in each served family's tool-call format, written by hand as the release's chat
template / encoder writes an assistant turn (newlines, spacing, markers), with what the parse must
give: content, calls (name, arguments as an object) and reasoning. Shared by test_tool_parsers.py and
test_server_tools.py."""
from __future__ import annotations

import dataclasses

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                   "filters": {"type": "object"}, "strict": {"type": "boolean"},
                                                   "limit": {"type": "number"}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    format: str                         # the tool_parsers format name
    text: str                           # the model's output (after the generation prompt)
    content: str | None
    calls: list[tuple[str, dict]]
    reasoning: str | None = None
    prompt: str = ""                    # the rendered prompt's tail (decides where reasoning starts)
    ids: tuple[str, ...] = ()           # ids the format writes itself (Kimi), else call_<random>


DS = "｜DSML｜"

CASES = [
    # --- Qwen3-Next: hermes JSON in <tool_call> ---------------------------------------------------------
    Case("hermes_one", "hermes",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    Case("hermes_text_then_two", "hermes",
         "I'll look up both.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"São Paulo\", "
         "\"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"東京 天気 🌧\", "
         "\"filters\": {\"site\": {\"domain\": \"jma.go.jp\", \"lang\": [\"ja\", \"en\"]}}, \"strict\": true}}\n"
         "</tool_call>",
         "I'll look up both.", [("get_weather", {"city": "São Paulo", "days": 3}),
                                ("search", {"query": "東京 天気 🌧", "filters": {"site": {"domain": "jma.go.jp",
                                                                                      "lang": ["ja", "en"]}},
                                            "strict": True})]),
    Case("hermes_thinking", "hermes",
         "The user wants the weather in Oslo.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
         "{\"city\": \"Oslo\"}}\n</tool_call>",
         None, [("get_weather", {"city": "Oslo"})], "The user wants the weather in Oslo.",
         prompt="<|im_start|>assistant\n<think>\n"),
    Case("hermes_malformed", "hermes",
         "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>",
         "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>", []),
    Case("hermes_cut_off", "hermes",
         "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"argu",
         "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"argu", []),
    Case("hermes_plain", "hermes", "Paris is the capital of France. Use <b>bold</b> < and >.",
         "Paris is the capital of France. Use <b>bold</b> < and >.", []),
    # --- Qwen3.5: qwen3_coder XML ------------------------------------------------------------------------
    Case("coder_one", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n</function>\n</tool_call>",
         None, [("get_weather", {"city": "San Francisco", "days": 3})]),
    Case("coder_thinking_text_two", "qwen3_coder",
         "Two lookups are needed.\n</think>\n\nLet me search first.\n\n<tool_call>\n<function=search>\n"
         "<parameter=query>\nline one\nline two: «ünïcode» 💡\n</parameter>\n<parameter=filters>\n"
         "{\"site\": {\"domain\": \"example.org\"}, \"years\": [2024, 2025]}\n</parameter>\n<parameter=strict>\nfalse\n"
         "</parameter>\n<parameter=limit>\n2.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>",
         "Let me search first.",
         [("search", {"query": "line one\nline two: «ünïcode» 💡",
                      "filters": {"site": {"domain": "example.org"}, "years": [2024, 2025]}, "strict": False,
                      "limit": 2.5}),
          ("get_weather", {"city": "42"})],
         "Two lookups are needed.", prompt="<|im_start|>assistant\n<think>\n"),
    Case("coder_malformed", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", []),
    # --- DeepSeek-V3.2: DSML function_calls --------------------------------------------------------------
    Case("dsml_two", "deepseek_v32",
         f"I'll check both.\n\n<{DS}function_calls>\n<{DS}invoke name=\"get_weather\">\n"
         f"<{DS}parameter name=\"city\" string=\"true\">杭州</{DS}parameter>\n"
         f"<{DS}parameter name=\"days\" string=\"false\">2</{DS}parameter>\n</{DS}invoke>\n"
         f"<{DS}invoke name=\"search\">\n<{DS}parameter name=\"query\" string=\"true\">a \"quoted\" query\n"
         f"over two lines</{DS}parameter>\n<{DS}parameter name=\"filters\" string=\"false\">"
         f"{{\"lang\": [\"zh\", \"en\"], \"nested\": {{\"x\": null}}}}</{DS}parameter>\n</{DS}invoke>\n"
         f"</{DS}function_calls>",
         "I'll check both.", [("get_weather", {"city": "杭州", "days": 2}),
                              ("search", {"query": "a \"quoted\" query\nover two lines",
                                          "filters": {"lang": ["zh", "en"], "nested": {"x": None}}})]),
    Case("dsml_thinking", "deepseek_v32",
         f"Need the weather.</think>\n\n<{DS}function_calls>\n<{DS}invoke name=\"get_weather\">\n"
         f"<{DS}parameter name=\"city\" string=\"true\">Lyon</{DS}parameter>\n</{DS}invoke>\n</{DS}function_calls>",
         None, [("get_weather", {"city": "Lyon"})], "Need the weather.", prompt="<｜Assistant｜><think>"),
    Case("dsml_malformed", "deepseek_v32",
         f"<{DS}function_calls>\n<{DS}invoke name=\"get_weather\">\n<{DS}parameter name=\"days\" string=\"false\">"
         f"two</{DS}parameter>\n</{DS}function_calls>",
         f"<{DS}function_calls>\n<{DS}invoke name=\"get_weather\">\n<{DS}parameter name=\"days\" string=\"false\">"
         f"two</{DS}parameter>\n</{DS}function_calls>", []),
    # --- DeepSeek-V4: DSML tool_calls --------------------------------------------------------------------
    Case("dsml_v4", "deepseek_v4",
         f"\n\n<{DS}tool_calls>\n<{DS}invoke name=\"search\">\n<{DS}parameter name=\"query\" string=\"true\">"
         f"naïve café</{DS}parameter>\n<{DS}parameter name=\"strict\" string=\"false\">true</{DS}parameter>\n"
         f"</{DS}invoke>\n</{DS}tool_calls>",
         None, [("search", {"query": "naïve café", "strict": True})]),
    Case("dsml_v4_cut_off", "deepseek_v4",
         f"Let me see.\n\n<{DS}tool_calls>\n<{DS}invoke name=\"search\">\n<{DS}par",
         f"Let me see.\n\n<{DS}tool_calls>\n<{DS}invoke name=\"search\">\n<{DS}par", []),
    # --- Kimi-Linear: Kimi-K2's sections ----------------------------------------------------------------
    Case("kimi_two", "kimi_k2",
         "Let me check the weather in both cities.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         "<|tool_call_argument_begin|>{\"city\": \"北京\"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1"
         "<|tool_call_argument_begin|>{\"city\": \"Montréal\", \"days\": 5}<|tool_call_end|><|tool_calls_section_end|>",
         "Let me check the weather in both cities.",
         [("get_weather", {"city": "北京"}), ("get_weather", {"city": "Montréal", "days": 5})],
         ids=("functions.get_weather:0", "functions.get_weather:1")),
    Case("kimi_nested", "kimi_k2",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:3<|tool_call_argument_begin|>"
         "{\"query\": \"x\", \"filters\": {\"a\": {\"b\": [1, {\"c\": \"d\"}]}}}<|tool_call_end|>"
         "<|tool_calls_section_end|>",
         None, [("search", {"query": "x", "filters": {"a": {"b": [1, {"c": "d"}]}}})], ids=("functions.search:3",)),
    Case("kimi_singular_section", "kimi_k2",
         "Checking.<|tool_call_section_begin|><|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>"
         "{\"city\": \"Kyoto\"}<|tool_call_end|><|tool_call_section_end|>",
         "Checking.", [("get_weather", {"city": "Kyoto"})], ids=("functions.get_weather:2",)),
    Case("kimi_malformed", "kimi_k2",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
         "{\"query\": }<|tool_call_end|><|tool_calls_section_end|>",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
         "{\"query\": }<|tool_call_end|><|tool_calls_section_end|>", []),
]
