package kube

import (
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// apiError maps an error from the Kubernetes API: an API that does not
// answer, is overloaded or times out is UNAVAILABLE and retryable; one that
// refuses the broker (RBAC, admission, a bad object) is not, since waiting
// will not change it. The cause stays in the log.
func apiError(err error, format string, args ...any) error {
	what := fmt.Sprintf(format, args...)
	switch {
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "exceeded quota"):
		return brokererr.Wrap(err, brokererr.Unavailable, "%s: the sandbox namespace's resource quota is used up", what)
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return brokererr.Wrap(err, brokererr.Unavailable, "%s: the Kubernetes API refused the broker (check its RBAC and the namespace's admission policy)", what).NotRetryable()
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err), apierrors.IsMethodNotSupported(err):
		return brokererr.Wrap(err, brokererr.InternalError, "%s: the Kubernetes API rejected the request", what).NotRetryable()
	case apierrors.IsNotFound(err):
		return brokererr.Wrap(err, brokererr.Unavailable, "%s: not found in the cluster", what).NotRetryable()
	case apierrors.IsTooManyRequests(err):
		e := brokererr.Wrap(err, brokererr.Unavailable, "%s: the Kubernetes API is overloaded", what)
		if s, ok := apierrors.SuggestsClientDelay(err); ok && s > 0 {
			e.RetryAfter = secondsDuration(s)
		}
		return e
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "%s: the Kubernetes API is unavailable", what)
}

func secondsDuration(s int) time.Duration { return time.Duration(s) * time.Second }
