"""The public HTTP doors: OpenAI's API (openai/: chat, completions, responses, models, LoRA
admin) and Anthropic's Messages API (anthropic/), and what they share: the request
preparation step (common.py), body limits, the header deadline, the linger that lets a
whole-body client read a 413, strict JSON bodies. The doors never call a scheduler: they go
through the tier's Generator (generation.py)."""
