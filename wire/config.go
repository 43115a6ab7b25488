package wire

import (
	"errors"
	"fmt"
)

// ErrInvalidConfig is wrapped by every *ConfigError.
var ErrInvalidConfig = errors.New("outbox: invalid configuration")

// ConfigError reports a configuration field that failed validation. It
// is the one shape of configuration error in the module: package relay
// returns it from New, and packages outbox, gormrelay, publisher and
// pgnotify return it from their constructors, each setting Package.
// outbox.ConfigError and relay.ConfigError are this type.
type ConfigError struct {
	Package string // the reporting package, e.g. "publisher"; "relay" when empty
	Field   string // the field, e.g. "LeaseRenewInterval" or "KafkaConfig.Brokers"
	Value   any    // the offending value
	Reason  string // what the field must be
	Err     error  // the underlying error, if any (e.g. a Configure hook's)
}

func (e *ConfigError) Error() string {
	pkg := e.Package
	if pkg == "" {
		pkg = "relay"
	}
	s := fmt.Sprintf("%s: invalid config %s=%v: %s", pkg, e.Field, e.Value, e.Reason)
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap lets errors.Is(err, ErrInvalidConfig) match, and errors.Is and
// errors.As reach Err.
func (e *ConfigError) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrInvalidConfig}
	}
	return []error{ErrInvalidConfig, e.Err}
}
