#!/usr/bin/env node
// Stream one qwenvl.gateway.v1.GatewayService/Generate from Node.js and print the result as
// JSON: {"text", "token_ids", "token_count", "finish_reason", "usage", "images"}.
//
// The protos are loaded at run time from splitvl's protos/ folder (no generated code), with
// @grpc/proto-loader; the call goes through @grpc/grpc-js. It is the proof that the protos
// are the product for clients outside Python (protos/README.md).
//
// Usage:
//   npm ci
//   node generate.js --address 127.0.0.1:50051 --image photo.png --prompt "Describe this image." \
//       [--max-tokens 16] [--ignore-eos] [--temperature 0] [--timeout-s 120] [--protos DIR]
//
// On a gRPC error it prints {"code": "INVALID_ARGUMENT", "details": "..."} to stderr and exits 1.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const { values: args } = parseArgs({
  options: {
    address: { type: 'string', default: '127.0.0.1:50051' },
    image: { type: 'string', multiple: true, default: [] },
    prompt: { type: 'string', default: 'Describe this image.' },
    'max-tokens': { type: 'string' },
    temperature: { type: 'string', default: '0' },
    'ignore-eos': { type: 'boolean', default: false },
    'timeout-s': { type: 'string', default: '120' },
    protos: { type: 'string', default: path.resolve(__dirname, '..', '..', 'protos') },
  },
});

// keepCase: field names as in the .proto (token_ids, finish_reason); enums as their names;
// int64 as strings (none is expected in responses, but a seed could be one in requests).
const definition = protoLoader.loadSync('qwenvl/gateway/v1/gateway_service.proto', {
  includeDirs: [args.protos],
  keepCase: true,
  enums: String,
  longs: String,
  defaults: true,
  oneofs: true,
});
const { GatewayService } = grpc.loadPackageDefinition(definition).qwenvl.gateway.v1;

const client = new GatewayService(args.address, grpc.credentials.createInsecure(), {
  // Responses are small (tokens); 16 MiB leaves room for long texts.
  'grpc.max_receive_message_length': 16 * 1024 * 1024,
  // Images travel in the request; the gateway's own limit (GATEWAY_MAX_IMAGE_BYTES) rules.
  'grpc.max_send_message_length': 256 * 1024 * 1024,
});

const parts = args.image.map((file) => ({ image: { data: fs.readFileSync(file) } }));
if (args.prompt) parts.push({ text: args.prompt });
const sampling = {
  temperature: Number(args.temperature),
  ignore_eos: args['ignore-eos'],
};
if (args['max-tokens'] !== undefined) sampling.max_tokens = Number(args['max-tokens']);
const request = { messages: [{ role: 'user', parts }], sampling };

const result = {
  text: '',
  token_ids: [],
  token_count: 0,
  finish_reason: '',
  usage: {},
  images: [],
};
const deadline = new Date(Date.now() + Number(args['timeout-s']) * 1000);
let failed = false;
const call = client.Generate(request, { deadline });

call.on('data', (chunk) => {
  if (chunk.images.length) {
    result.images = chunk.images.map((im) => ({
      index: im.index,
      tier: im.tier,
      similarity: im.similarity,
      grid: im.grid ? [im.grid.t, im.grid.h, im.grid.w].map(Number) : [],
      tokens: im.tokens,
      key: im.key,
    }));
  }
  result.token_ids.push(...chunk.token_ids);
  result.text += chunk.text;
  if (chunk.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
    result.finish_reason = chunk.finish_reason;
    result.usage = chunk.usage;
  }
});

call.on('error', (err) => {
  failed = true;
  const code = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) || String(err.code);
  process.stderr.write(`${JSON.stringify({ code, details: err.details })}\n`);
  client.close();
  process.exitCode = 1;
});

call.on('end', () => {
  if (failed) return;
  result.token_count = result.token_ids.length;
  process.stdout.write(`${JSON.stringify(result)}\n`);
  client.close();
});
