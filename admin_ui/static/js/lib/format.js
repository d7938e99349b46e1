// Numbers, money, sizes and times as people read them.

const integer = new Intl.NumberFormat("en-US");
const compact = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

export function count(value) {
  return value === null || value === undefined ? "–" : integer.format(value);
}

/** "1 adapter", "3 adapters". */
export function plural(n, one, many = `${one}s`) {
  return `${count(n)} ${n === 1 ? one : many}`;
}

export function compactCount(value) {
  return compact.format(value);
}

/** USD from a float of dollars: cents, and more digits only where an amount needs them. */
export function usd(dollars) {
  if (dollars === null || dollars === undefined) return "–";
  const abs = Math.abs(dollars);
  const most = abs === 0 || abs >= 1 ? 2 : abs >= 0.01 ? 4 : 6;
  const digits = { minimumFractionDigits: 2, maximumFractionDigits: most };
  return `$${dollars.toLocaleString("en-US", digits)}`;
}

/** An axis tick in USD: as many decimals as the axis step needs, the same on every tick. */
export function usdTick(value, step) {
  if (value === 0) return "$0";
  let decimals = 2;
  while (
    decimals < 8 &&
    Math.abs(Math.round(step * 10 ** decimals) - step * 10 ** decimals) > 1e-6
  ) {
    decimals += 1;
  }
  return `$${value.toFixed(decimals)}`;
}

/** Exact integer micro-dollars as USD. */
export function microUsd(micro) {
  return usd(micro / 1e6);
}

export function bytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let amount = value;
  let unit = 0;
  while (amount >= 1024 && unit < units.length - 1) {
    amount /= 1024;
    unit += 1;
  }
  return `${amount.toFixed(unit === 0 || amount >= 100 ? 0 : 1)} ${units[unit]}`;
}

export function ms(value) {
  if (value === null || value === undefined) return "–";
  return value >= 1000
    ? `${(value / 1000).toFixed(2)} s`
    : `${value.toFixed(value >= 100 ? 0 : 1)} ms`;
}

export function dateTime(iso) {
  if (!iso) return "–";
  const when = new Date(iso);
  return when.toLocaleString("en-GB", {
    year: "numeric",
    month: "short",
    day: "numeric",
    hour: "2-digit",
    minute: "2-digit",
  });
}

export function relative(iso) {
  if (!iso) return "never";
  const seconds = Math.round((Date.now() - new Date(iso).getTime()) / 1000);
  if (seconds < 60) return "just now";
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return `${Math.floor(seconds / 86400)} d ago`;
}

/** A UTC day (YYYY-MM-DD) as "3 May". */
export function shortDay(day) {
  const [year, month, date] = day.split("-").map(Number);
  return new Date(Date.UTC(year, month - 1, date)).toLocaleDateString("en-GB", {
    day: "numeric",
    month: "short",
    timeZone: "UTC",
  });
}

/** Today's UTC date as YYYY-MM-DD, shifted by `days`. */
export function utcDay(days = 0) {
  const now = new Date();
  const day = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate() + days));
  return day.toISOString().slice(0, 10);
}

export function addDays(day, days) {
  const [year, month, date] = day.split("-").map(Number);
  return new Date(Date.UTC(year, month - 1, date + days)).toISOString().slice(0, 10);
}

/** Every day from `start` to `end`, both inclusive (YYYY-MM-DD strings). */
export function daysBetween(start, end) {
  const days = [];
  for (let day = start; day <= end && days.length < 400; day = addDays(day, 1)) days.push(day);
  return days;
}
