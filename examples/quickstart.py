"""Five-line D3D usage: the target's own greedy output, decoded with a D3D drafter as assistant_model."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_d3d.targets import DEFAULT_TARGET, resolve_target

# On a machine with Hub access these are plain ids: "HuggingFaceTB/SmolLM2-135M-Instruct" and a D3D drafter repo.
target_path = resolve_target(DEFAULT_TARGET)  # offline: the packaged SmolLM2 converted to a local cache
drafter_path = "checkpoints/SmolLM2-135M-Instruct-D3D"

tokenizer = AutoTokenizer.from_pretrained(target_path)
target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
drafter = AutoModelForCausalLM.from_pretrained(drafter_path, trust_remote_code=True, dtype=torch.float32)
question = "Natalia sold clips to 48 friends in April and half as many in May. How many clips did she sell in all?"
messages = [{"role": "user", "content": question}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128, do_sample=False)
plain = target.generate(**inputs, max_new_tokens=128, do_sample=False)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print("identical to plain greedy generate:", torch.equal(out, plain))
