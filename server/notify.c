/* Service manager protocol: notifications (sd_notify) and socket activation (sd_listen_fds). */
#include "server/notify.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef HAVE_LIBSYSTEMD
#include <systemd/sd-daemon.h>

int md_notify(const char *state)
{
	int rc = sd_notify(0, state);
	return rc < 0 ? rc : 0;
}

uint64_t md_notify_watchdog_usec(void)
{
	uint64_t usec = 0;
	return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}

int md_notify_listen_fd(int *n_fds)
{
	int n = sd_listen_fds(1);
	*n_fds = n > 0 ? n : 0;
	if (n <= 0)
		return 0;
	if (sd_is_socket(SD_LISTEN_FDS_START, AF_UNSPEC, SOCK_STREAM, 1) <= 0)
		return -ENOTSOCK;
	return SD_LISTEN_FDS_START;
}
#else
#include <sys/socket.h>
#include <sys/un.h>

/* The protocol is one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET ('@' = abstract). */
int md_notify(const char *state)
{
	const char *path = getenv("NOTIFY_SOCKET");
	if (!path || !*path)
		return 0;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t len = strlen(path);
	if (len >= sizeof(sa.sun_path) || (path[0] != '/' && path[0] != '@'))
		return -EINVAL;
	memcpy(sa.sun_path, path, len);
	if (path[0] == '@')
		sa.sun_path[0] = 0;
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
	ssize_t n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, sl);
	int rc = n < 0 ? -errno : 0;
	close(fd);
	return rc;
}

uint64_t md_notify_watchdog_usec(void)
{
	const char *s = getenv("WATCHDOG_USEC");
	const char *pid = getenv("WATCHDOG_PID");
	if (!s)
		return 0;
	if (pid && (pid_t)strtol(pid, NULL, 10) != getpid())
		return 0;
	return strtoull(s, NULL, 10);
}

/* The protocol: descriptors 3 .. 3+$LISTEN_FDS-1, meant for the process $LISTEN_PID. */
int md_notify_listen_fd(int *n_fds)
{
	const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
	*n_fds = 0;
	bool ours = pid && fds && (pid_t)strtol(pid, NULL, 10) == getpid();
	int n = ours ? (int)strtol(fds, NULL, 10) : 0;
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	if (n <= 0)
		return 0;
	*n_fds = n;
	for (int fd = 3; fd < 3 + n; fd++)
		fcntl(fd, F_SETFD, FD_CLOEXEC);
	int type = 0, listening = 0;
	socklen_t l = sizeof(type), l2 = sizeof(listening);
	if (getsockopt(3, SOL_SOCKET, SO_TYPE, &type, &l) || type != SOCK_STREAM ||
	    getsockopt(3, SOL_SOCKET, SO_ACCEPTCONN, &listening, &l2) || !listening)
		return -ENOTSOCK;
	return 3;
}
#endif
