"""The names of the output parsers a deployment chooses (`--reasoning-parser`,
`--tool-call-parser`), as vLLM names them: shared by the serving config and the text package
that implements them."""

from typing import Literal

ReasoningParserName = Literal["deepseek_r1", "qwen3"]
ToolCallParserName = Literal["auto", "hermes", "llama3_json", "mistral", "json"]
