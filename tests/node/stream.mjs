// A streamed chat completion through the official OpenAI SDK for Node.js, with
// stream_options.include_usage. Prints one JSON line: the joined text, the finish_reason, the
// usage chunk (and how many choices it had), the number of chunks and of those that carried text.
// Run by tests/test_node_sdk.py (copied beside the SDK's node_modules first).
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.EZAT_BASE_URL,
  apiKey: process.env.EZAT_API_KEY,
  maxRetries: 0,
});

const stream = await client.chat.completions.create({
  model: process.env.EZAT_MODEL,
  max_tokens: 64,
  stream: true,
  stream_options: { include_usage: true },
  messages: [{ role: "user", content: "Count from 1 to 10." }],
});

let text = "";
let finishReason = null;
let usage = null;
let usageChoices = null;
let chunks = 0;
let textChunks = 0;
for await (const chunk of stream) {
  chunks += 1;
  const choice = chunk.choices[0];
  if (choice?.delta?.content) {
    text += choice.delta.content;
    textChunks += 1;
  }
  if (choice?.finish_reason) finishReason = choice.finish_reason;
  if (chunk.usage) {
    usage = chunk.usage;
    usageChoices = chunk.choices.length;
  }
}
console.log(JSON.stringify({
  text,
  finish_reason: finishReason,
  usage,
  usage_choices: usageChoices,
  chunks,
  text_chunks: textChunks,
}));
