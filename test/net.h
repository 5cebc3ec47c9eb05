/* test/net.h — a TCP socket on 127.0.0.1 with a port of the kernel's
 * choosing, for tests that need a port where UCX finds nobody (bound, not
 * listening: connections are refused) or a listener that never answers
 * UCX's handshake (listening, never accepting); and a check that an
 * address is not this machine's. */
#ifndef DP_TEST_NET_H
#define DP_TEST_NET_H
#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <criterion/criterion.h>

static inline int t_loopback_socket(int do_listen, int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  if (do_listen) cr_assert_eq(listen(fd, 4), 0);
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  *port = ntohs(sa.sin_port);
  return fd;
}

/* Skips the test when ip (TEST-NET-1's, for one) is an address of this
 * machine: the tests that use it need one bind() refuses. */
static inline void t_skip_if_local(const char *ip) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  inet_pton(AF_INET, ip, &a.sin_addr);
  int bound = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  if (bound) cr_skip_test("%s is an address of this machine", ip);
}
#endif
