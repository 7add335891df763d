#!/usr/bin/env node
// Trains a duelq learner from Node.js: GetInfo, a few TrainSteps, a TrainStream and a
// ComputeEntropy, then prints what came back as one JSON object.
//
//   node example.js --target localhost:50051 [--token T] [--steps 3] [--stream 4] [--rows 16]
//
// The token defaults to $DUELQ_TOKEN. Batch i is made by batch() below from exact binary
// fractions, so any other client can build the same one (tests/test_node_client.py does,
// in Python, and gets the same losses). Exit code 0, or 1 with the error on stderr.
'use strict';

const { parseArgs } = require('node:util');
const { LearnerClient, tensor, values } = require('./learner');

// Batch i of B rows for H features and N actions: every value exact in float32.
function batch(i, B, H, N) {
  const hT = [], hTp1 = [], actions = [], rewards = [], dones = [], discounts = [];
  for (let b = i * 17; b < i * 17 + B; b++) {
    for (let c = 0; c < H; c++) {
      hT.push(((b * 7 + c * 3) % 11) / 8 - 0.625);
      hTp1.push(((b * 5 + c * 2) % 13) / 16 - 0.375);
    }
    actions.push((b * 3) % N);
    rewards.push(((b % 5) - 2) / 4);
    dones.push(b % 7 === 0 ? 1 : 0);
    discounts.push(0.96875);
  }
  return {
    h_t: tensor(hT, [B, H]),
    h_tp1: tensor(hTp1, [B, H]),
    actions: tensor(actions, [B], 'DTYPE_INT32'),
    rewards: tensor(rewards, [B]),
    dones: tensor(dones, [B]),
    discounts: tensor(discounts, [B]),
  };
}

function step(response) {
  return { loss: response.loss, step: response.step, td_errors: values(response.td_errors),
    grad_norm: response.grad_norm, seq: response.key ? response.key.seq : 0 };
}

async function main() {
  const { values: args } = parseArgs({ options: {
    target: { type: 'string', default: 'localhost:50051' },
    token: { type: 'string', default: process.env.DUELQ_TOKEN || '' },
    steps: { type: 'string', default: '3' },
    stream: { type: 'string', default: '4' },
    rows: { type: 'string', default: '16' },
  } });
  const [steps, streamed, rows] = [args.steps, args.stream, args.rows].map(Number);
  const client = new LearnerClient(args.target, { token: args.token });
  try {
    const info = await client.info();
    const { hidden_dim: H, n_actions: N } = info.config; // typed: no JSON to parse
    const actor = `node-${process.pid}`;
    const keyed = (i) => ({ ...batch(i, rows, H, N), key: { actor_id: actor, seq: i + 1 } });
    const out = { info: { backend: info.backend, hidden_dim: H, n_actions: N, step: info.step },
      steps: [], stream: [] };
    for (let i = 0; i < steps; i++) out.steps.push(step(await client.trainStep(keyed(i))));
    const requests = Array.from({ length: streamed }, (_, k) => keyed(steps + k));
    out.stream = (await client.trainStream(requests)).map(step);
    const taken = Array.from({ length: 40 }, (_, k) => (k * k) % N);
    const entropy = await client.computeEntropy({
      actions: tensor(taken, [taken.length], 'DTYPE_INT32'),
      slot: { name: 'action_entropy_ema' }, alpha: 0.5,
      key: { actor_id: actor, seq: steps + streamed + 1 },
    });
    out.entropy = { entropy: entropy.entropy, ema: entropy.ema, slot: entropy.slot };
    process.stdout.write(`${JSON.stringify(out)}\n`);
  } finally {
    client.close();
  }
}

main().catch((error) => {
  process.stderr.write(`duelq example: ${error.message}\n`);
  process.exit(1);
});
