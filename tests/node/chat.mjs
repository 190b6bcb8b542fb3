// A plain chat completion through the official OpenAI SDK for Node.js: a system message and
// max_tokens. Prints one JSON line: the reply's content, finish_reason and usage.
// Run by tests/test_node_sdk.py (copied beside the SDK's node_modules first).
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.EZAT_BASE_URL,
  apiKey: process.env.EZAT_API_KEY,
  maxRetries: 0,
});

const completion = await client.chat.completions.create({
  model: process.env.EZAT_MODEL,
  max_tokens: 64,
  messages: [
    { role: "system", content: "Answer in one sentence." },
    { role: "user", content: "What is a prompt cache?" },
  ],
});
const [choice] = completion.choices;
console.log(JSON.stringify({
  object: completion.object,
  model: completion.model,
  content: choice.message.content,
  finish_reason: choice.finish_reason,
  usage: completion.usage,
}));
