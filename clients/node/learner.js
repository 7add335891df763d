// A duelq learner client for Node.js. The stubs are generated at load time from
// protos/duelq/v1/learner.proto as it is (@grpc/proto-loader, field names kept in
// lower_snake_case); tensors are written and read as the proto's Tensor comment says:
// raw little-endian, row-major bytes, whatever the host's byte order.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.join(__dirname, '..', '..', 'protos', 'duelq', 'v1', 'learner.proto');
const definition = protoLoader.loadSync(PROTO, {
  keepCase: true, // h_tp1, not hTp1
  longs: Number, // uint64 step and version: exact up to 2^53
  enums: String, // "DTYPE_FLOAT32"
  defaults: true,
  oneofs: true,
});
const duelq = grpc.loadPackageDefinition(definition).duelq.v1;

// The wire dtypes this client writes and reads: element size and DataView accessors.
// (float16 and bfloat16, 2 bytes, are accepted by the server for features; not used here.)
const DTYPES = {
  DTYPE_FLOAT32: { size: 4, get: 'getFloat32', set: 'setFloat32' },
  DTYPE_INT32: { size: 4, get: 'getInt32', set: 'setInt32' },
  DTYPE_UINT8: { size: 1, get: 'getUint8', set: 'setUint8' },
  DTYPE_BOOL: { size: 1, get: 'getUint8', set: 'setUint8' },
};

// A Tensor of `values` (flat, row-major) with `shape` and `dtype`.
function tensor(values, shape, dtype = 'DTYPE_FLOAT32') {
  const { size, set } = DTYPES[dtype];
  const count = shape.reduce((a, b) => a * b, 1);
  if (values.length !== count) {
    throw new Error(`${values.length} values for shape [${shape}]`);
  }
  const data = Buffer.alloc(count * size);
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  for (let i = 0; i < count; i++) view[set](i * size, values[i], true);
  return { dtype, shape, data };
}

// The values of a Tensor, flat and row-major.
function values(t) {
  const { size, get } = DTYPES[t.dtype];
  const view = new DataView(t.data.buffer, t.data.byteOffset, t.data.byteLength);
  const out = new Array(t.data.length / size);
  for (let i = 0; i < out.length; i++) out[i] = view[get](i * size, true);
  return out;
}

// One connection to a learner; every call carries the bearer token when one is given.
class LearnerClient {
  constructor(target, { token = '', credentials = grpc.credentials.createInsecure(),
    timeoutMs = 30000 } = {}) {
    this.stub = new duelq.Learner(target, credentials);
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
    this.timeoutMs = timeoutMs;
  }

  unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata, { deadline: Date.now() + this.timeoutMs },
        (error, response) => (error ? reject(error) : resolve(response)));
    });
  }

  info() { return this.unary('GetInfo', {}); }

  trainStep(request) { return this.unary('TrainStep', request); }

  computeEntropy(request) { return this.unary('ComputeEntropy', request); }

  // Sends `requests` on one TrainStream; resolves to their responses, in order.
  trainStream(requests) {
    return new Promise((resolve, reject) => {
      const call = this.stub.TrainStream(this.metadata);
      const responses = [];
      call.on('data', (response) => responses.push(response));
      call.on('error', reject);
      call.on('end', () => resolve(responses));
      for (const request of requests) call.write(request);
      call.end();
    });
  }

  close() { this.stub.close(); }
}

module.exports = { LearnerClient, tensor, values, duelq, grpc };
