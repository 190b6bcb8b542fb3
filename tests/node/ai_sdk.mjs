// The Vercel AI SDK's OpenAI provider, whose default model (`provider(id)`) speaks the Responses
// API. `node ai_sdk.mjs <case>` runs one case and prints one JSON line:
//   generate  generateText: the text, finish reason and usage
//   stream    streamText: the joined text, how many deltas carried it, finish reason and usage
//   tools     generateText with a get_weather tool it executes, then the answer (two requests)
//   thinking  the same with reasoning on and store: false (the reasoning goes back as an item)
//   stored    the same with reasoning on and the default store: true (the reasoning goes back as
//             an item_reference); an error the SDK raised is printed instead
//   stream-tools  streamText with the get_weather tool: the answer, how many deltas carried it,
//             the steps and calls
// Run by tests/test_vercel_ai.py (copied beside the SDK's node_modules first).
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const provider = createOpenAI({ baseURL: process.env.EZAT_BASE_URL, apiKey: process.env.EZAT_API_KEY });
const model = provider(process.env.EZAT_MODEL);
const which = process.argv[2];

// A get_weather tool the SDK runs itself, noting each city it is called for in `calls`.
const weather = (calls) => ({
  get_weather: tool({
    description: "Current weather for a city",
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => {
      calls.push(city);
      return `9°C and clear in ${city}`;
    },
  }),
});

if (which === "generate") {
  const result = await generateText({ model, maxOutputTokens: 64, maxRetries: 0, prompt: "What is a prompt cache?" });
  console.log(JSON.stringify({ text: result.text, finish_reason: result.finishReason, usage: result.usage }));
} else if (which === "stream") {
  const result = streamText({ model, maxOutputTokens: 64, maxRetries: 0, prompt: "Count from 1 to 10." });
  let deltas = 0;
  for await (const delta of result.textStream) {
    if (delta) deltas += 1;
  }
  console.log(JSON.stringify({
    text: await result.text,
    deltas,
    finish_reason: await result.finishReason,
    usage: await result.usage,
  }));
} else if (which === "stream-tools") {
  const calls = [];
  const result = streamText({
    model,
    maxOutputTokens: 64,
    maxRetries: 0,
    prompt: "What's the weather in Oslo? Use the tool.",
    tools: weather(calls),
    stopWhen: stepCountIs(2),
  });
  let deltas = 0;
  for await (const delta of result.textStream) {
    if (delta) deltas += 1;
  }
  console.log(JSON.stringify({
    text: await result.text,
    deltas,
    steps: (await result.steps).length,
    calls,
    finish_reason: await result.finishReason,
  }));
} else if (which === "tools" || which === "thinking" || which === "stored") {
  // The SDK sends reasoning settings only for OpenAI's reasoning models unless forceReasoning says so.
  const reasoning = { forceReasoning: true, reasoningEffort: "medium" };
  const providerOptions = {
    tools: {},
    thinking: { openai: { ...reasoning, store: false } },
    stored: { openai: reasoning },
  }[which];
  const calls = [];
  try {
    const result = await generateText({
      model,
      maxOutputTokens: 64,
      maxRetries: 0,
      providerOptions,
      prompt: "What's the weather in Oslo? Use the tool.",
      tools: weather(calls),
      stopWhen: stepCountIs(2),
    });
    console.log(JSON.stringify({ text: result.text, steps: result.steps.length, calls, finish_reason: result.finishReason }));
  } catch (error) {
    console.log(JSON.stringify({ error: error.message, status: error.statusCode ?? null, calls }));
  }
} else {
  throw new Error(`unknown case ${which}`);
}
