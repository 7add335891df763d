// unpack_batch.cu — a train request's bytes, copied to the device as they came off the wire,
// unpacked into learner_step's packed input layout.
//
// A request read in place (server/wire.py) leaves each tensor's data at whatever byte offset
// of the message protobuf's framing puts it. The host copies the whole message to the device
// with one H2D copy; this kernel gathers the pieces: segment s (h_t, h_tp1, actions, rewards,
// dones, discounts, and weights when present) is the words [start[s], start[s + 1]) of `out`,
// read from byte offset src_offset[s] of `src`. A word at an unaligned address is read as
// the two aligned words around it and a funnel shift, so `src` must have 4 readable bytes
// past the message. Grid: any; each thread takes words a grid apart.

#define MAX_SEGMENTS 7

struct UnpackArgs {
    const unsigned char* src;             // the message on the device
    unsigned int* out;                    // packed inputs (learner_step.cu's layout)
    long long src_offset[MAX_SEGMENTS];   // byte offset of each segment in src
    long long start[MAX_SEGMENTS + 1];    // first word of each segment in out; then the total
    int segments;                         // 6, or 7 with weights
};

extern "C" __global__ void unpack_batch(const UnpackArgs a) {
    const long long total = a.start[a.segments];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < total; w += stride) {
        int s = 0;
        while (s + 1 < a.segments && w >= a.start[s + 1]) ++s;
        const size_t at = (size_t)(a.src + a.src_offset[s]) + 4 * (size_t)(w - a.start[s]);
        const unsigned int* word = reinterpret_cast<const unsigned int*>(at & ~(size_t)3);
        const unsigned int shift = 8 * (unsigned int)(at & 3);
        a.out[w] = shift ? __funnelshift_r(word[0], word[1], shift) : word[0];  // little-endian
    }
}
