// The testbed's delay line (benchmarks/netbed.py): joins two network
// namespaces through a pair of TAP interfaces and holds every frame for a
// fixed one-way delay before handing it to the other side. It stands in for
// the kernel's netem qdisc, which the kernels this project runs on lack.
//
//   netbed_delay NETNS_A IFNAME_A NETNS_B IFNAME_B DELAY_A_TO_B_NS DELAY_B_TO_A_NS [QUEUES]
//
// Creates IFNAME_A inside NETNS_A and IFNAME_B inside NETNS_B (named
// namespaces under /var/run/netns), each with QUEUES queues (default 1),
// prints "ready" and forwards frames until
// its standard input closes (its owner exited or died) or a signal ends it;
// the interfaces go with it. The caller configures them (address, MTU, tbf
// for the rate) like any other interface.
//
// The TAP interfaces take TCP segmentation and checksum offload (virtio-net
// headers, as a VM's vhost does), so a TCP flow crosses in segments of up to
// 64 KiB; one thread copies ~3 GB/s. For more, the interfaces take several
// queues (IFF_MULTI_QUEUE): the kernel puts each flow on one queue by its
// hash, and one thread per queue and direction forwards queue i of one side
// to queue i of the other, so a flow's frames keep their order and several
// flows (the sockets of a collective) cross in parallel. A frame
// is stamped when it is read and written out once its delay has passed, in
// the order frames came. A thread that is waking from sleep would add its
// wake-up time (tens of us on a loaded machine) to the delay, so it polls
// without sleeping while frames are due within kSpinNs and, after the last
// frame, for kIdleSpinNs plus two round trips of delay (so a request and its
// answer find both directions awake; one core per busy queue, yielding it
// to anything else runnable); otherwise it sleeps in ppoll with a timer slack
// of 1 ns.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

enum {
  kMaxFrame = 65536 + 64,  // a 64 KiB segment, its Ethernet and virtio-net headers
  kSlots = 512,            // frames in flight per queue and direction
  kMaxQueues = 16,         // queues of a TAP interface, each a thread per direction
  kSpinNs = 30000,         // closer than this to a frame's time, poll without sleeping
  kIdleSpinNs = 200000,    // after the last frame, poll this long (+ 2 round trips) before sleeping
};

struct Frame {
  uint64_t due_ns;
  ssize_t len;
  char* data;
};

struct Direction {
  const char* name;
  int src, dst;
  uint64_t delay_ns;
  uint64_t idle_spin_ns;
  struct Frame slots[kSlots];
};

static void die(const char* what, const char* detail) {
  fprintf(stderr, "netbed_delay: %s %s: %s\n", what, detail, strerror(errno));
  exit(1);
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

// The `queues` queues of a TAP interface `ifname` inside the named namespace
// `netns` (one descriptor each, in fds), with offloads, non-blocking. The
// calling thread is back in its own namespace afterwards.
static void open_tap(const char* netns, const char* ifname, int queues, int* fds) {
  char path[512];
  snprintf(path, sizeof path, "/var/run/netns/%s", netns);
  const int self = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  const int target = open(path, O_RDONLY | O_CLOEXEC);
  if (self < 0 || target < 0) die("cannot open the namespace", path);
  if (setns(target, CLONE_NEWNET) != 0) die("cannot enter", path);
  for (int q = 0; q < queues; ++q) {
    const int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) die("cannot open", "/dev/net/tun");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | (queues > 1 ? IFF_MULTI_QUEUE : 0);
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", ifname);
    if (ioctl(fd, TUNSETIFF, &ifr) != 0) die("cannot create the TAP interface", ifname);
    if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) != 0)
      die("cannot set the offloads of", ifname);
    fds[q] = fd;
  }
  if (setns(self, CLONE_NEWNET) != 0) die("cannot go back to", "/proc/self/ns/net");
  close(self);
  close(target);
}

static void* forward(void* arg) {
  struct Direction* d = arg;
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  // ppoll wakes within its timeout's ns
  for (int i = 0; i < kSlots; ++i) {
    d->slots[i].data = malloc(kMaxFrame);
    if (!d->slots[i].data) die("out of memory for", d->name);
  }
  unsigned head = 0, count = 0;
  uint64_t last_frame_ns = 0;
  for (;;) {
    // Take every frame that is there (a full line leaves the rest queued in the TAP).
    while (count < kSlots) {
      struct Frame* f = &d->slots[(head + count) % kSlots];
      const ssize_t n = read(d->src, f->data, kMaxFrame);
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) break;
        if (errno == EBADFD || errno == EIO) break;  // interface not up yet
        die("read failed on", d->name);
      }
      f->len = n;
      last_frame_ns = now_ns();
      f->due_ns = last_frame_ns + d->delay_ns;
      ++count;
    }
    const uint64_t now = now_ns();
    while (count > 0 && d->slots[head].due_ns <= now) {
      struct Frame* f = &d->slots[head];
      // A frame the other side cannot take (its interface down) is lost, as on a wire.
      if (write(d->dst, f->data, (size_t)f->len) < 0 && errno != EIO && errno != EAGAIN &&
          errno != EINVAL && errno != EBADFD)
        die("write failed on", d->name);
      head = (head + 1) % kSlots;
      --count;
    }
    struct pollfd p = {.fd = d->src, .events = count < kSlots ? POLLIN : 0};
    const uint64_t t_now = now_ns();
    if (count == 0) {
      if (t_now - last_frame_ns > d->idle_spin_ns)
        poll(&p, 1, 100);
      else
        sched_yield();
      continue;
    }
    const int64_t wait = (int64_t)(d->slots[head].due_ns - t_now) - kSpinNs;
    if (wait <= 0) {
      sched_yield();
      continue;
    }
    const struct timespec t = {(time_t)(wait / 1000000000), (long)(wait % 1000000000)};
    ppoll(&p, 1, &t, NULL);
  }
  return NULL;
}

static uint64_t parse_u64(const char* text, const char* what) {
  char* end = NULL;
  const unsigned long long v = strtoull(text, &end, 10);
  if (!*text || *end) {
    fprintf(stderr, "netbed_delay: not %s: %s\n", what, text);
    exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    fprintf(stderr,
            "usage: netbed_delay NETNS_A IFNAME_A NETNS_B IFNAME_B DELAY_A_TO_B_NS "
            "DELAY_B_TO_A_NS [QUEUES]\n");
    return 2;
  }
  const uint64_t queues = argc == 8 ? parse_u64(argv[7], "a queue count") : 1;
  if (queues < 1 || queues > kMaxQueues) {
    fprintf(stderr, "netbed_delay: QUEUES must be 1..%d, not %s\n", kMaxQueues, argv[7]);
    return 2;
  }
  const int nq = (int)queues;
  int a[kMaxQueues], b[kMaxQueues];
  open_tap(argv[1], argv[2], nq, a);
  open_tap(argv[3], argv[4], nq, b);
  const uint64_t delay_ab = parse_u64(argv[5], "a delay in ns"),
                 delay_ba = parse_u64(argv[6], "a delay in ns");
  const uint64_t idle_spin_ns = kIdleSpinNs + 2 * (delay_ab + delay_ba);
  // Direction structs are large (their slot tables): static, one per queue and direction.
  static struct Direction dirs[2 * kMaxQueues];
  pthread_t t[2 * kMaxQueues];
  for (int q = 0; q < nq; ++q) {
    dirs[2 * q] = (struct Direction){.name = argv[2],
                                     .src = a[q],
                                     .dst = b[q],
                                     .delay_ns = delay_ab,
                                     .idle_spin_ns = idle_spin_ns};
    dirs[2 * q + 1] = (struct Direction){.name = argv[4],
                                         .src = b[q],
                                         .dst = a[q],
                                         .delay_ns = delay_ba,
                                         .idle_spin_ns = idle_spin_ns};
  }
  for (int i = 0; i < 2 * nq; ++i) {
    if (pthread_create(&t[i], NULL, forward, &dirs[i]) != 0)
      die("cannot start", "the forwarding threads");
  }
  printf("ready\n");
  fflush(stdout);
  // Until the owner closes our standard input (or dies): then the interfaces go.
  char buf[64];
  while (read(0, buf, sizeof buf) > 0) {
  }
  return 0;
}
