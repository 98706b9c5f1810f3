import os

from openai import OpenAI  # against `PIC_API_KEY=KEY pic serve --model smollm2`

client = OpenAI(base_url=os.environ.get("PIC_BASE_URL", "http://127.0.0.1:8000/v1"), api_key="KEY")
docs = [
    "The river Elbe rises in the Czech Republic and flows into the North Sea near Cuxhaven.\n",
    "Hamburg, Germany's largest port, lies on the Elbe about 110 kilometres from the sea.\n",
]
question = "Into which sea does the Elbe flow?"
out = client.chat.completions.create(
    model="smollm2",
    max_tokens=32,
    temperature=0,
    messages=[
        {"role": "system", "content": "Answer the question using the documents."},
        {"role": "user", "content": f"Question: {question}\n\n{{documents}}Question: {question}"},
    ],
    extra_body={"pic": {"documents": docs}},  # compiled once in the chat's context, cached by the server
)
print(out.choices[0].message.content)
print(out.usage)  # prompt_tokens, completion_tokens, and pic's reused_tokens and recomputed_tokens
