// ShmGroup: the collectives of a tensor-parallel group whose ranks share a machine, over one
// shared-memory region every rank maps (threads of one process or processes of their own).
//
//   line 0            magic, the broken flag (any rank may set it: every wait then throws)
//   lines 1..16       per rank: its pid, its last collective's sequence number, its last
//                     command acknowledged
//   line 17           the command's sequence number (a futex word) and length
//   command area      the last command's bytes (the leader's, rank 0)
//   data area         two buffers of `world` slots: collective k uses buffer k % 2
//
// A collective: each rank copies its part into its slot of the round's buffer, publishes the
// round's number, waits until every rank has published it, then reads every slot in rank order
// (so every rank computes the same bits: an all-reduce sums ranks 0, 1, ... in that order).
// Two buffers are enough: a rank that starts round k + 2 has seen every rank publish k + 1,
// which each did only after reading round k's slots. Waits spin briefly, then yield; past a
// second they check that the other ranks' processes live, and past `timeout_s` they throw.
//
// Commands run the followers (ranks 1..) in the leader's steps: the leader writes a command
// once every follower acknowledged the previous one (a follower acknowledges as soon as it has
// copied it out), bumps the sequence number and wakes sleeping followers (futex); an idle
// follower sleeps in the kernel instead of spinning. Larger commands go in several parts.

#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

class ShmGroup {
 public:
  static constexpr int64_t kMaxRanks = 16;
  static constexpr int64_t kLine = 64;
  static constexpr int64_t kMagic = 0x6d737461722d7470;  // "mstar-tp"

  static int64_t region_bytes(int64_t world, int64_t slot_bytes, int64_t command_bytes) {
    return kLine * (2 + kMaxRanks) + round_up(command_bytes) + 2 * world * round_up(slot_bytes);
  }

  ShmGroup(at::Tensor region, int64_t rank, int64_t world, int64_t slot_bytes, int64_t command_bytes,
           double timeout_s)
      : region_(std::move(region)), rank_(rank), world_(world), slot_(round_up(slot_bytes)),
        command_bytes_(round_up(command_bytes)), timeout_s_(timeout_s) {
    TORCH_CHECK(world_ >= 1 && world_ <= kMaxRanks && rank_ >= 0 && rank_ < world_,
                "ShmGroup: rank ", rank_, " of ", world_, " (at most ", kMaxRanks, " ranks)");
    TORCH_CHECK(region_.scalar_type() == at::kByte && region_.is_contiguous() &&
                    region_.numel() >= region_bytes(world_, slot_, command_bytes_),
                "ShmGroup: a uint8 region of region_bytes(world, slot_bytes, command_bytes) expected");
    base_ = static_cast<char*>(region_.data_ptr());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(base_) % kLine == 0, "ShmGroup: the region must be 64-byte aligned");
    // A fresh region is zeros (a group that restarts takes a new one), and every count starts
    // there: a follower that maps it after the leader sent its first commands still reads them
    // (the leader sends the next only once every follower acknowledged the last).
    reinterpret_cast<std::atomic<int64_t>*>(base_)->store(kMagic);
    *reinterpret_cast<int64_t*>(rank_line(rank_)) = getpid();
  }

  int64_t rank() const { return rank_; }
  // The rank found gone (its process exited) by the last call that failed; -1 while none is.
  int64_t lost() const { return lost_; }
  int64_t world() const { return world_; }

  // Sum `x` over the ranks, in place (every rank gets the same bits): float32, float64, and
  // bfloat16 or float16 summed in float32 and rounded once.
  void all_reduce_(at::Tensor x) {
    const auto type = x.scalar_type();
    TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() &&
                    (type == at::kFloat || type == at::kDouble || type == at::kBFloat16 || type == at::kHalf),
                "ShmGroup.all_reduce_: a contiguous CPU float32, float64, bfloat16 or float16 tensor expected");
    if (world_ == 1) return;
    const int64_t item = x.element_size();
    const int64_t per_round = slot_ / item;
    char* data = static_cast<char*>(x.data_ptr());
    for (int64_t start = 0; start < x.numel(); start += per_round) {
      const int64_t n = std::min(per_round, x.numel() - start);
      char* part = data + start * item;
      const int64_t round = publish(part, n * item);
      if (type == at::kFloat) {
        sum_slots(reinterpret_cast<float*>(part), round, n);
      } else if (type == at::kDouble) {
        sum_slots(reinterpret_cast<double*>(part), round, n);
      } else if (type == at::kBFloat16) {
        sum_slots(reinterpret_cast<c10::BFloat16*>(part), round, n);
      } else {
        sum_slots(reinterpret_cast<c10::Half*>(part), round, n);
      }
    }
  }

  // Every rank's `x` (the same shape on each), stacked: [world, *x.shape].
  at::Tensor all_gather(const at::Tensor& x) {
    TORCH_CHECK(x.device().is_cpu(), "ShmGroup.all_gather: a CPU tensor expected");
    const at::Tensor src = x.contiguous();
    std::vector<int64_t> shape{world_};
    shape.insert(shape.end(), src.sizes().begin(), src.sizes().end());
    at::Tensor out = at::empty(shape, src.options());
    const int64_t bytes = src.numel() * src.element_size();
    const char* data = static_cast<const char*>(src.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t start = 0; start < bytes || start == 0; start += slot_) {
      const int64_t n = std::min(slot_, bytes - start);
      const int64_t round = publish(data + start, n);
      for (int64_t r = 0; r < world_; ++r) std::memcpy(dst + r * bytes + start, slot(round, r), n);
      if (bytes == 0) break;
    }
    return out;
  }

  // The leader's command to every follower (rank 0 only).
  void send(const at::Tensor& bytes) {
    TORCH_CHECK(rank_ == 0, "ShmGroup.send: only rank 0 sends commands");
    TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.is_contiguous(), "ShmGroup.send: contiguous uint8 expected");
    const int64_t total = bytes.numel();
    const char* data = static_cast<const char*>(bytes.data_ptr());
    int64_t done = 0;
    do {
      const int64_t n = std::min(command_bytes_ - 8, total - done);
      for (int64_t r = 1; r < world_; ++r) wait_for(counter(r, 16), command_seq_, r);
      std::memcpy(command_area() + 8, data + done, n);
      *reinterpret_cast<int64_t*>(command_area()) = total;
      *reinterpret_cast<int64_t*>(command_line() + 8) = n;
      done += n;
      command_word().store(++command_seq_, std::memory_order_release);
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&command_word()), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
    } while (done < total);
  }

  // The leader's next command (followers): blocks, asleep when idle.
  at::Tensor receive() {
    TORCH_CHECK(rank_ > 0, "ShmGroup.receive: rank 0 sends commands");
    at::Tensor out;
    int64_t done = 0, total = -1;
    do {
      await_command();
      const int64_t n = *reinterpret_cast<int64_t*>(command_line() + 8);
      if (total < 0) {
        total = *reinterpret_cast<int64_t*>(command_area());
        out = at::empty({total}, at::kByte);
      }
      std::memcpy(static_cast<char*>(out.data_ptr()) + done, command_area() + 8, n);
      done += n;
      counter(rank_, 16).store(command_seq_, std::memory_order_release);
    } while (done < total);
    return out;
  }

  // Mark the group broken: every rank's waits throw from now on (a rank that stops or fails).
  void abort() {
    broken().store(1, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&command_word()), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }

  bool is_broken() { return broken().load(std::memory_order_acquire) != 0; }

 private:
  static int64_t round_up(int64_t n) { return (n + kLine - 1) / kLine * kLine; }

  char* rank_line(int64_t r) const { return base_ + kLine * (1 + r); }
  std::atomic<uint32_t>& counter(int64_t r, int64_t offset) const {
    return *reinterpret_cast<std::atomic<uint32_t>*>(rank_line(r) + offset);
  }
  std::atomic<uint32_t>& broken() const { return *reinterpret_cast<std::atomic<uint32_t>*>(base_ + 8); }
  char* command_line() const { return base_ + kLine * (1 + kMaxRanks); }
  std::atomic<uint32_t>& command_word() const { return *reinterpret_cast<std::atomic<uint32_t>*>(command_line()); }
  char* command_area() const { return base_ + kLine * (2 + kMaxRanks); }
  char* slot(uint32_t round, int64_t r) const {
    return command_area() + command_bytes_ + ((round & 1) * world_ + r) * slot_;
  }

  // Copy `n` bytes into this rank's slot of the next round, publish it, wait for every rank's.
  uint32_t publish(const char* data, int64_t n) {
    const uint32_t round = ++seq_;
    std::memcpy(slot(round, rank_), data, n);
    counter(rank_, 8).store(round, std::memory_order_release);
    for (int64_t r = 0; r < world_; ++r) {
      if (r != rank_) wait_for(counter(r, 8), round, r);
    }
    return round;
  }

  template <typename T>
  void sum_slots(T* out, uint32_t round, int64_t n) const {
    std::vector<const T*> parts(world_);
    for (int64_t r = 0; r < world_; ++r) parts[r] = reinterpret_cast<const T*>(slot(round, r));
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    for (int64_t i = 0; i < n; ++i) {
      Acc acc = static_cast<Acc>(parts[0][i]);
      for (int64_t r = 1; r < world_; ++r) acc += static_cast<Acc>(parts[r][i]);
      out[i] = static_cast<T>(acc);
    }
  }

  // Wait until `word` reaches `target` (wrapping counters: compared by signed difference).
  void wait_for(std::atomic<uint32_t>& word, uint32_t target, int64_t peer) {
    auto reached = [&] { return static_cast<int32_t>(word.load(std::memory_order_acquire) - target) >= 0; };
    if (reached()) return;
    for (int spin = 0; spin < 4096; ++spin) {
      if (reached()) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    const auto start = std::chrono::steady_clock::now();
    auto checked = start;
    while (!reached()) {
      sched_yield();
      const auto now = std::chrono::steady_clock::now();
      if (now - checked > std::chrono::milliseconds(200)) {
        checked = now;
        check_alive(peer, std::chrono::duration<double>(now - start).count());
      }
    }
  }

  // Wait for the next command part, asleep in the kernel while none comes.
  void await_command() {
    const uint32_t last = command_seq_;
    for (int spin = 0; spin < 4096; ++spin) {
      if (command_word().load(std::memory_order_acquire) != last) {
        ++command_seq_;
        return;
      }
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    const struct timespec tick = {0, 200 * 1000 * 1000};
    while (command_word().load(std::memory_order_acquire) == last) {
      if (is_broken()) TORCH_CHECK(false, "ShmGroup: the group was stopped");
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&command_word()), FUTEX_WAIT, last, &tick, nullptr, 0);
      // An idle follower waits as long as it takes; only the leader's death ends the wait.
      const auto pid = *reinterpret_cast<int64_t*>(rank_line(0));
      if (pid != getpid() && pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        lost_ = 0;
        TORCH_CHECK(false, "ShmGroup: the leader (rank 0, pid ", pid, ") is gone");
      }
    }
    ++command_seq_;
  }

  void check_alive(int64_t peer, double waited_s) {
    if (is_broken()) TORCH_CHECK(false, "ShmGroup: the group was stopped");
    const auto pid = *reinterpret_cast<int64_t*>(rank_line(peer));
    if (pid > 0 && pid != getpid() && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      lost_ = peer;
      TORCH_CHECK(false, "ShmGroup: rank ", peer, " (pid ", pid, ") is gone");
    }
    TORCH_CHECK(waited_s < timeout_s_, "ShmGroup: rank ", peer, " did not answer within ", timeout_s_, " s");
  }

  at::Tensor region_;
  char* base_;
  int64_t rank_, world_, slot_, command_bytes_;
  double timeout_s_;
  uint32_t seq_ = 0, command_seq_ = 0;
  int64_t lost_ = -1;
};
