// A tool-call loop through the official OpenAI SDK for Node.js: the first request offers a
// get_weather function and gets tool_calls back; the program sends the assistant message and a
// tool result for each call, and prints the final answer. Prints one JSON line per request.
// Run by tests/test_node_sdk.py (copied beside the SDK's node_modules first).
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.EZAT_BASE_URL,
  apiKey: process.env.EZAT_API_KEY,
  maxRetries: 0,
});

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Current weather for a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string" } },
        required: ["city"],
      },
    },
  },
];
const messages = [{ role: "user", content: "What's the weather in Oslo? Use the tool." }];
const model = process.env.EZAT_MODEL;

const first = await client.chat.completions.create({ model, max_tokens: 64, messages, tools });
const reply = first.choices[0].message;
console.log(JSON.stringify({
  finish_reason: first.choices[0].finish_reason,
  content: reply.content,
  tool_calls: reply.tool_calls ?? null,
}));

if (first.choices[0].finish_reason === "tool_calls") {
  messages.push(reply);
  for (const call of reply.tool_calls) {
    const { city } = JSON.parse(call.function.arguments);
    messages.push({ role: "tool", tool_call_id: call.id, content: `9°C and clear in ${city}` });
  }
  const second = await client.chat.completions.create({ model, max_tokens: 64, messages, tools });
  console.log(JSON.stringify({
    finish_reason: second.choices[0].finish_reason,
    content: second.choices[0].message.content,
  }));
}
