// The testbed's delay line (benchmarks/netbed.py): joins two network
// namespaces through a pair of TAP interfaces and holds every frame for a
// fixed one-way delay before handing it to the other side. It stands in for
// the kernel's netem qdisc, which the kernels this project runs on lack.
//
//   netbed_delay NETNS_A IFNAME_A NETNS_B IFNAME_B DELAY_A_TO_B_NS DELAY_B_TO_A_NS
//
// Creates IFNAME_A inside NETNS_A and IFNAME_B inside NETNS_B (named
// namespaces under /var/run/netns), prints "ready" and forwards frames until
// its standard input closes (its owner exited or died) or a signal ends it;
// the interfaces go with it. The caller configures them (address, MTU, tbf
// for the rate) like any other interface.
//
// The TAP interfaces take TCP segmentation and checksum offload (virtio-net
// headers, as a VM's vhost does), so a TCP flow crosses in segments of up to
// 64 KiB and one thread per direction keeps up with tens of Gbit/s. A frame
// is stamped when it is read and written out once its delay has passed, in
// the order frames came. A thread that is waking from sleep would add its
// wake-up time (tens of us on a loaded machine) to the delay, so it polls
// without sleeping while frames are due within kSpinNs and, after the last
// frame, for kIdleSpinNs plus two round trips of delay (so a request and its
// answer find both directions awake; one core per busy direction, yielding it
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
  kSlots = 512,            // frames in flight per direction
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

// A TAP interface `ifname` inside the named namespace `netns`, with offloads,
// non-blocking. The calling thread is back in its own namespace afterwards.
static int open_tap(const char* netns, const char* ifname) {
  char path[512];
  snprintf(path, sizeof path, "/var/run/netns/%s", netns);
  const int self = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  const int target = open(path, O_RDONLY | O_CLOEXEC);
  if (self < 0 || target < 0) die("cannot open the namespace", path);
  if (setns(target, CLONE_NEWNET) != 0) die("cannot enter", path);
  const int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) die("cannot open", "/dev/net/tun");
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
  snprintf(ifr.ifr_name, IFNAMSIZ, "%s", ifname);
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) die("cannot create the TAP interface", ifname);
  if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) != 0)
    die("cannot set the offloads of", ifname);
  if (setns(self, CLONE_NEWNET) != 0) die("cannot go back to", "/proc/self/ns/net");
  close(self);
  close(target);
  return fd;
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

static uint64_t parse_ns(const char* text) {
  char* end = NULL;
  const unsigned long long v = strtoull(text, &end, 10);
  if (!*text || *end) {
    fprintf(stderr, "netbed_delay: not a delay in ns: %s\n", text);
    exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 7) {
    fprintf(stderr,
            "usage: netbed_delay NETNS_A IFNAME_A NETNS_B IFNAME_B DELAY_A_TO_B_NS "
            "DELAY_B_TO_A_NS\n");
    return 2;
  }
  static struct Direction ab, ba;
  const int a = open_tap(argv[1], argv[2]), b = open_tap(argv[3], argv[4]);
  ab = (struct Direction){.name = argv[2], .src = a, .dst = b, .delay_ns = parse_ns(argv[5])};
  ba = (struct Direction){.name = argv[4], .src = b, .dst = a, .delay_ns = parse_ns(argv[6])};
  ab.idle_spin_ns = ba.idle_spin_ns = kIdleSpinNs + 2 * (ab.delay_ns + ba.delay_ns);
  pthread_t t[2];
  if (pthread_create(&t[0], NULL, forward, &ab) != 0 ||
      pthread_create(&t[1], NULL, forward, &ba) != 0)
    die("cannot start", "the forwarding threads");
  printf("ready\n");
  fflush(stdout);
  // Until the owner closes our standard input (or dies): then the interfaces go.
  char buf[64];
  while (read(0, buf, sizeof buf) > 0) {
  }
  return 0;
}
