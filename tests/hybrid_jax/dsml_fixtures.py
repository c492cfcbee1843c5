"""What the DeepSeek encoders' tests share: a tool, a call of it, and that call as DSML writes it (a blank
line, then the calls block: `function_calls` for V3.2, `tool_calls` for V4)."""
from __future__ import annotations

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}


def dsml_call(section: str) -> str:
    """CALL in a DSML block named `section` (string="true" for strings, JSON otherwise)."""
    return (f'\n\n<｜DSML｜{section}>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
            f'</｜DSML｜invoke>\n</｜DSML｜{section}>')
